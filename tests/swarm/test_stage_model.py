"""The stage-grain throughput model (`kvq.swarm.stage_model`): calibrated from windows made by
known costs it finds them again, its check reproduces their tok/s, cohorts hide round trips
only when holders compute apart, and `throughput_report` refuses reports of mixed grains."""

from __future__ import annotations

from typing import Any

import pytest

from kvq.errors import RoutingError
from kvq.swarm.calibrate import throughput_report
from kvq.swarm.stage_model import (
    STAGE_SHAPES,
    StageCosts,
    StageShape,
    calibrate_stages,
    step_ms,
    tok_s,
)

TRUE = StageCosts(h0=9.0, h1=1.5, l0=4.0, l1=0.8, hop0=3.0, rtts=1.0)
LAYERS, SPANS = 16, 3
SHAPE = {
    "layers": LAYERS,
    "experts": 64,
    "experts_used": 8,
    "hidden": 2048,
    "expert_ffn": 1024,
    "heads": 16,
    "kv_heads": 16,
    "head_dim": 128,
    "slices_per_layer": 1,
    "vocab": 50304,
    "blocks": LAYERS,
}


def _run(b: int, rtt: float, hops: float, steps: int = 100) -> dict[str, Any]:
    """A window the true costs would give (one cohort, the holders on one CPU)."""
    coord = TRUE.h0 + TRUE.h1 * b
    work = LAYERS * (TRUE.l0 + TRUE.l1 * b)
    wall = coord + work + hops * (TRUE.hop0 + TRUE.rtts * rtt)
    tokens = steps * b
    return {
        "rtt_ms": rtt,
        "sequences": b,
        "tokens": tokens,
        "window_s": wall * steps / 1000,
        "tok_s": 1000 * b / wall,
        "wait_ms_per_layer_token": (wall - coord) / (b * SPANS),
        "workers_cpu_s": work * steps / 1000,
        "jobs_per_layer_token": hops / (b * SPANS),
    }


def _report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "grain": "stage",
        "preset": None,
        "slices": SPANS,
        "workers": 3,
        "microbatches": 1,
        "shape": SHAPE,
        "runs": runs,
    }


def test_calibration_finds_the_costs_that_made_the_windows() -> None:
    runs = [
        _run(b, rtt, hops) for b in (1, 8, 32) for rtt in (0.0, 20.0, 50.0) for hops in (2.0, 3.0)
    ]
    got = calibrate_stages([_report(runs)])
    for f in ("h0", "h1", "l0", "l1", "hop0", "rtts"):
        assert getattr(got, f) == pytest.approx(getattr(TRUE, f), rel=1e-6), f
    out = throughput_report([_report(runs)], ["deepseek-v3"], (4,), (20.0,), 32)
    assert out["grain"] == "stage" and out["max_abs_error"] < 1e-6


def test_cohorts_hide_round_trips_only_where_holders_compute_apart() -> None:
    shape = STAGE_SHAPES["deepseek-v3"]
    apart = StageCosts(1.0, 0.1, 20.0, 1.0, 2.0, 1.0, shared_cpu=False)
    one = tok_s(shape, apart, 8, 80.0, 32)
    best = max(tok_s(shape, apart, 8, 80.0, 32, m) for m in range(1, 9))
    assert best > 1.5 * one  # the holders each busy with a cohort of their own
    shared = StageCosts(1.0, 0.1, 20.0, 1.0, 2.0, 1.0, shared_cpu=True)
    # on one CPU the holders' work is the bound: more cohorts only read the weights more often
    assert tok_s(shape, shared, 8, 80.0, 32, 4) <= tok_s(shape, shared, 8, 80.0, 32, 1) * 1.01
    flat = StageShape("x", 8, 1.0, 1.0)
    assert step_ms(flat, apart, 2, 10.0, 1) == pytest.approx(1.1 + 2 * (2.0 + 10.0) + 8 * 21.0)


def test_reports_of_both_grains_are_refused() -> None:
    stage = _report([_run(1, 20.0, 3.0)])
    expert = dict(stage, grain="expert")
    with pytest.raises(RoutingError, match="mixes"):
        throughput_report([stage, expert], ["deepseek-v3"], (4,), (20.0,), 32)
