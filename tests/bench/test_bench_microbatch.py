"""`kvq bench microbatch` on a tiny model (a real worker process, few steps): the paired
report's shape and sane values; bad options refused first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.microbatch import MicrobatchBench, run_microbatch_bench
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_microbatch_bench_pairs_the_arms(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=2, experts=8, experts_used=2)
    r = run_microbatch_bench(
        MicrobatchBench(
            model=str(model),
            sequences=4,
            max_tokens=6,
            warmup_steps=4,
            pairs=6,
            log_dir=str(tmp_path / "logs"),
        )
    )
    assert set(r["arms"]) == {"1", "2"}
    for arm in r["arms"].values():
        assert arm["steps"] == 6 and arm["mean_ms"] > 0 and arm["remote_jobs_per_step"] >= 0
    assert r["mean_ratio"] > 0
    assert len(os.sched_getaffinity(0)) >= 2, "the bench gives this process its CPUs back"


@pytest.mark.parametrize(
    "bad", [{"microbatches": 1}, {"microbatches": 9}, {"rtt_ms": -1.0}, {"pairs": 0}]
)
def test_bad_options_are_refused_first(bad: dict) -> None:
    with pytest.raises(ConfigError):
        MicrobatchBench(**bad).check()
