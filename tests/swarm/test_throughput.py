"""The throughput model of `kvq swarm-sim --throughput` (issue 33 item 6): the closed formula
against an event-by-event schedule, the batch that hides the round trips against a brute-force
search, monotonicity, and a calibration that recovers the costs it was given."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvq.cli import main
from kvq.swarm.calibrate import bench_shape, calibrate, throughput_report
from kvq.swarm.throughput import (
    SHAPES,
    Costs,
    LayerTimes,
    Shape,
    busiest,
    contacted,
    gqa_params,
    hidden,
    hiding_batch,
    jobs,
    layer_ms,
    layer_times,
    simulate_period,
    tok_s,
)

SMALL = Shape("small", 8, 32, 4, 1024, 512, 8, gqa_params(1024, 8, 4, 128, 32))
COSTS = Costs(c0=0.6, c1=0.15, o_job=0.3, c_row=0.05, r0_0=0.8, r0_1=0.02, workers_parallel=0)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "t",
    [
        LayerTimes(1.0, 5.0, 0.5),
        LayerTimes(4.0, 3.0, 1.0),
        LayerTimes(1.0, 3.0, 2.5),
        LayerTimes(2.0, 2.0, 0.0),
        LayerTimes(0.3, 40.0, 10.0),
    ],
)
def test_the_formula_is_the_simulated_schedule(t: LayerTimes, m: int) -> None:
    formula = max(m * t.coord, t.coord + t.wait, m * t.worker)
    assert simulate_period(t, m) == pytest.approx(formula, rel=1e-6)


@pytest.mark.parametrize("rtt", [0.0, 5.0, 20.0, 80.0])
@pytest.mark.parametrize("workers", [8, 32])
def test_the_hiding_batch_is_the_smallest_the_brute_force_finds(rtt: float, workers: int) -> None:
    shape = SHAPES["qwen3-235b-a22b"]
    c = COSTS.scaled(SMALL, shape)

    def brute(m: int) -> int | None:  # the schedule bound by a machine's compute alone
        for batch in range(m, 4097, m):
            t = layer_times(shape, c, workers, rtt, batch / m)
            if simulate_period(t, m, layers=60) <= max(m * t.coord, m * t.worker) * (1 + 1e-9):
                return batch
        return None

    found = [(b, m) for m in (2, 4, 8) if (b := brute(m)) is not None]
    want = min(found) if found else None
    got = hiding_batch(shape, c, workers, rtt)
    assert (got[0] if got else None) == (want[0] if want else None)
    if got:
        assert hidden(shape, c, workers, rtt, *got)


def test_tok_s_falls_with_rtt_and_rises_with_batch_and_workers() -> None:
    shape = SHAPES["deepseek-v3"]
    c = COSTS.scaled(SMALL, shape)
    by_rtt = [tok_s(shape, c, 32, rtt, 16) for rtt in (0, 5, 20, 40, 80)]
    assert by_rtt == sorted(by_rtt, reverse=True)
    by_batch = [tok_s(shape, c, 32, 20, b) for b in (1, 2, 4, 8, 16, 64, 256)]
    assert by_batch == sorted(by_batch)
    by_workers = [tok_s(shape, c, w, 20, 64) for w in (3, 8, 32, 128)]
    assert by_workers == sorted(by_workers)
    free = replace(c, c0=0.0)  # without a fixed cost per pass, micro-batches never lose
    for m in (2, 4, 8):
        assert tok_s(shape, free, 32, 80, 64, m) >= tok_s(shape, free, 32, 80, 64)


def test_jobs_count_slices_touched() -> None:
    assert jobs(SMALL, 1) == pytest.approx(8 * (1 - (7 / 8) ** 4))
    assert jobs(SMALL, 1000) == pytest.approx(8.0)


def _synthetic(c: Costs, workers: int, rtts: tuple[float, ...]) -> dict[str, Any]:
    """A bench report whose windows the model itself produced (1 CPU for the workers)."""
    runs = []
    for rtt in rtts:
        for b in (1, 8):
            t = layer_times(SMALL, c, workers, rtt, b)
            steps = 1000.0
            n = steps * SMALL.layers
            runs.append(
                {
                    "rtt_ms": rtt,
                    "sequences": b,
                    "tokens": int(steps * b),
                    "window_s": layer_ms(SMALL, c, workers, rtt, b) * n / 1000,
                    "coord_cpu_s": t.coord * n / 1000,
                    "workers_cpu_s": t.worker * n / 1000,
                    "wait_ms_per_layer_token": t.wait / b,
                    "jobs_per_layer_token": jobs(SMALL, b) / b,
                    "tok_s": tok_s(SMALL, c, workers, rtt, b),
                }
            )
    shape = {
        "layers": 8,
        "experts": 32,
        "experts_used": 4,
        "hidden": 1024,
        "expert_ffn": 512,
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 128,
        "slices_per_layer": 8,
    }
    return {"preset": "small", "shape": shape, "workers": workers, "microbatches": 1, "runs": runs}


def test_calibration_recovers_the_costs_and_predicts_other_rtts() -> None:
    truth = Costs(
        0.6,
        0.15,
        0.3,
        0.05,
        0.8,
        0.02,
        rtts_per_job=0.9,
        rtts_fixed=1.1,
        r_contact=0.4,
        rtts_contact=0.3,
        workers_parallel=1,
    )
    reps = [_synthetic(truth, w, (0.0, 5.0, 20.0)) for w in (1, 3)]
    got = calibrate(reps)
    for f in (
        "c0",
        "c1",
        "o_job",
        "c_row",
        "r0_0",
        "r0_1",
        "rtts_per_job",
        "rtts_fixed",
        "r_contact",
        "rtts_contact",
    ):
        assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=1e-6, abs=1e-9), f
    assert bench_shape(reps[0]).backbone_params == SMALL.backbone_params
    held_out = _synthetic(truth, 2, (0.0, 5.0, 20.0))  # predicted, not fitted
    out = throughput_report(
        [*reps, held_out], ["qwen3-235b-a22b"], (8,), (20.0,), 32, calibrate_with=2
    )
    assert out["max_abs_error"] <= 1e-3 and len(out["check"]) == 18
    assert [c["predicted"] for c in out["check"]] == [False] * 12 + [True] * 6
    assert [r["workers"] for r in out["calibrated_from"]] == [1, 3]
    row = out["projection"][0]
    assert row["shape"] == "qwen3-235b-a22b" and row["tok_s_b1"] > 0
    assert row["tok_s_b32_best_m"] >= row["tok_s_b32"]


def test_a_lone_worker_waits_fewer_round_trips_than_one_per_job() -> None:
    """The fixed and per-job RTTs come apart only across worker counts: with both, a lone
    worker's layer waits rtts_fixed + rtts_per_job x J RTTs, fewer than the old charge."""
    c = Costs(0.6, 0.15, 0.3, 0.05, 0.8, rtts_per_job=0.5, rtts_fixed=1.0, workers_parallel=1)
    one = layer_times(SMALL, c, 1, 20.0, 1, n_jobs=4.0)
    three = layer_times(SMALL, c, 3, 20.0, 1, n_jobs=4.0)
    assert one.wait - three.wait == pytest.approx(20.0 * 0.5 * (4.0 - busiest(4.0, 3)))
    assert contacted(4.0, 1) == 1.0 and contacted(4.0, 3) == pytest.approx(3 * (1 - (2 / 3) ** 4))


def test_the_fit_keeps_every_cost_non_negative() -> None:
    """A cost the windows would fit below 0 is dropped, not returned negative."""
    truth = Costs(0.6, 0.15, 0.3, 0.05, 0.8, 0.0, rtts_per_job=1.2, workers_parallel=1)
    rep = _synthetic(truth, 3, (0.0, 20.0))
    for run in rep["runs"]:  # noise that pulls r0_1 below zero
        run["window_s"] *= 1.0 - 0.01 * run["sequences"]
    got = calibrate([rep])
    assert (
        min(
            getattr(got, f)
            for f in (
                "c0",
                "c1",
                "o_job",
                "c_row",
                "r0_0",
                "r0_1",
                "rtts_per_job",
                "rtts_fixed",
                "r_contact",
            )
        )
        >= 0
    )


def test_the_cli_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bench.json"
    f.write_text(
        json.dumps(_synthetic(Costs(0.6, 0.15, 0.3, 0.05, 0.8, workers_parallel=1), 2, (0.0, 20.0)))
    )
    assert (
        main(
            [
                "swarm-sim",
                "--throughput",
                "--measured",
                str(f),
                "--workers",
                "8,32",
                "--rtt-ms",
                "20",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {r["workers"] for r in out["projection"]} == {8, 32}
    assert main(["swarm-sim"]) == 2 and "--topology is required" in capsys.readouterr().err
    assert main(["swarm-sim", "--throughput", "--measured", str(f), "--calibrate", "2"]) == 2
    assert "--calibrate 2: there are 1 reports" in capsys.readouterr().err
    f.write_text("{}")
    assert main(["swarm-sim", "--throughput", "--measured", str(f)]) == 2
    assert "not a usable kvq bench pool report" in capsys.readouterr().err
