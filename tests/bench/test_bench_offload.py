"""`kvq bench offload` end to end on a tiny model (real processes, pinned; short windows): the
JSON it reports, and bad options refused before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.offload import OffloadBench, _summary, run_offload_bench
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_offload_bench_runs_the_real_processes(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=2, experts=8, experts_used=2)
    r = run_offload_bench(
        OffloadBench(
            model=str(model),
            rtts_ms=(0.0, 10.0),
            microbatches=(1, 2),
            sequences=4,
            max_tokens=4,
            warmup_s=1.0,
            measure_s=2.0,
            log_dir=str(tmp_path / "logs"),
        )
    )
    assert r["baseline"]["tok_s"] > 0 and r["baseline"]["before"]["tokens"] > 0
    assert [(run["rtt_ms"], run["microbatches"]) for run in r["runs"]] == [
        (0.0, 1),
        (0.0, 2),
        (10.0, 1),
        (10.0, 2),
    ]
    for run in r["runs"]:
        assert run["tok_s"] > 0 and run["speedup"] > 0 and run["worker_load_s"] >= 0
        assert 0.0 <= run["remote_share"] <= 1.0
        # a coordinator's time: its own expert compute plus its wait can not exceed the window
        assert 0.0 <= run["expert_share"] and 0.0 <= run["wait_share"]
        assert run["expert_share"] + run["wait_share"] + run["send_share"] <= 1.05
        assert run["send_share"] >= 0.0
        assert run["local_ms_per_row"] > 0  # the coordinator computes one slice at least
        assert run["local_jobs"] + run["remote_jobs"] > 0
        if run["microbatches"] == 1:
            assert run["microbatched_steps"] == 0
    # a baseline after every run; each run is measured against the two beside it
    phases = r["baseline"]["phases"]
    assert len(phases) == len(r["runs"]) + 1 and all(b["tokens"] > 0 for b in phases)
    for i, run in enumerate(r["runs"]):
        beside = (phases[i]["tok_s"] + phases[i + 1]["tok_s"]) / 2
        assert run["baseline_tok_s"] == pytest.approx(beside, abs=1e-3)
        assert run["speedup"] == pytest.approx(run["tok_s"] / beside, abs=2e-3)
    assert [(row["rtt_ms"], row["microbatches"], row["speedups"]) for row in r["summary"]] == [
        (run["rtt_ms"], run["microbatches"], [run["speedup"]]) for run in r["runs"]
    ]
    assert 0.0 < r["baseline"]["expert_share"] < 1.0, "all-local: the experts take part of it"
    assert r["split_bound"] == pytest.approx(1 / (1 - r["baseline"]["expert_share"] / 2), abs=2e-3)
    assert r["cpus"]["coordinator"] != r["cpus"]["worker"]
    assert len(os.sched_getaffinity(0)) >= 2, "the bench gives this process its CPUs back"


@pytest.mark.parametrize(
    "bad",
    [
        {"rtts_ms": (-1.0,)},
        {"sequences": 1},
        {"measure_s": 0.0},
        {"max_tokens": 0},
        {"microbatches": (0,)},
        {"microbatches": (9,)},
        {"microbatches": ()},
        {"repeat": 0},
    ],
)
def test_bad_options_are_refused_first(bad: dict) -> None:
    with pytest.raises(ConfigError):
        OffloadBench(**bad).check()


def test_summary_takes_the_median_over_repeats() -> None:
    runs = [
        {"rtt_ms": rtt, "microbatches": 1, "speedup": sp, "remote_share": rs}
        for rtt, sp, rs in [
            (0.0, 1.2, 0.4),
            (5.0, 0.9, 0.1),
            (0.0, 1.0, 0.5),
            (5.0, 1.1, 0.0),
            (0.0, 1.3, 0.3),
            (5.0, 1.0, 0.2),
        ]
    ]
    assert _summary(runs) == [
        {
            "rtt_ms": 0.0,
            "microbatches": 1,
            "speedup_median": 1.2,
            "speedups": [1.2, 1.0, 1.3],
            "remote_share_median": 0.4,
        },
        {
            "rtt_ms": 5.0,
            "microbatches": 1,
            "speedup_median": 1.0,
            "speedups": [0.9, 1.1, 1.0],
            "remote_share_median": 0.1,
        },
    ]
    # a run without a baseline tok/s has no speed-up: left out of the median, not a 0
    none = [
        {"rtt_ms": 0.0, "microbatches": 1, "speedup": sp, "remote_share": 0.1}
        for sp in (None, 1.1, 1.3)
    ]
    assert _summary(none)[0]["speedup_median"] == 1.2
