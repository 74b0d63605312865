"""`kvq swarm-sim --throughput`: the throughput model calibrated from `kvq bench pool` reports,
checked against every measured window, then projected to other shapes, swarms and RTTs.

Calibration (one report, its lowest RTT, its smallest and largest `sequences` B1 < B2): with
steps = tokens / B and L MoE layers, per layer and step
  coordinator C = wall ms / (steps L) - its wait    -> c0, c1 (a line through the two points;
                 (`remote_wait_s`, per layer-step)     not its CPU time, which holds polling)
  workers     W = their CPU ms / (steps L) = o_job J + c_row B k  (J: jobs per layer-step,
                                                      measured)     -> o_job, c_row
  fixed       r = wall ms / (steps L) - C - W       -> r0_0, r0_1 (at RTT 0)
and, from its highest RTT, the RTTs each job of the busiest worker adds to a layer's wait
(`rtts_per_job`: the rest of the wall time over RTT x the expected jobs of the busiest of the
report's workers). The windows at other RTTs and other worker counts check the result, with
each window's measured jobs per layer (the bench's router is skewed and its windows hold
prefills: the uniform-routing count `jobs` is for the projections only).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvq.errors import RoutingError
from kvq.swarm.throughput import (
    SHAPES,
    Costs,
    Shape,
    busiest,
    gqa_params,
    hiding_batch,
    jobs,
    tok_s,
)


def bench_shape(report: dict[str, Any]) -> Shape:
    s = report["shape"]
    return Shape(
        report.get("preset") or "bench", s["layers"], s["experts"], s["experts_used"],
        s["hidden"], s["expert_ffn"], s["slices_per_layer"],
        gqa_params(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["experts"]),
    )  # fmt: skip


def _per_layer_step(run: dict[str, Any], layers: int) -> dict[str, float]:
    b = run["sequences"]
    steps = run["tokens"] / b
    n = steps * layers
    wall, wait = 1000 * run["window_s"] / n, run["wait_ms_per_layer_token"] * b
    return {
        "b": b, "coord": wall - wait, "work": 1000 * run["workers_cpu_s"] / n,
        "wall": wall, "jobs": run["jobs_per_layer_token"] * b,
        "rtt": run["rtt_ms"],
    }  # fmt: skip


def calibrate(report: dict[str, Any]) -> Costs:
    """Costs from one bench report (see the module docstring)."""
    shape = bench_shape(report)
    runs = [r for r in report["runs"] if r["tokens"] > 0]
    if not runs:
        raise RoutingError("the bench report has no window with tokens: nothing to calibrate")
    low = min(r["rtt_ms"] for r in runs)
    at = sorted((r for r in runs if r["rtt_ms"] == low), key=lambda r: r["sequences"])
    p1, p2 = (_per_layer_step(r, shape.layers) for r in (at[0], at[-1]))
    k = shape.experts_used
    if p2["b"] == p1["b"]:
        c1, c0 = 0.0, p1["coord"]
        o_job, c_row = 0.0, p1["work"] / (p1["b"] * k)
        r1 = 0.0
    else:
        c1 = (p2["coord"] - p1["coord"]) / (p2["b"] - p1["b"])
        c0 = p1["coord"] - c1 * p1["b"]
        det = p1["jobs"] * p2["b"] * k - p2["jobs"] * p1["b"] * k
        o_job = (p1["work"] * p2["b"] * k - p2["work"] * p1["b"] * k) / det if det else 0.0
        c_row = (p1["work"] - o_job * p1["jobs"]) / (p1["b"] * k)
        if o_job < 0 or c_row < 0:  # the two points do not separate them: all per row
            o_job, c_row = 0.0, p2["work"] / (p2["b"] * k)
        r1 = 0.0
    w = report["workers"]
    rest = [p["wall"] - p["coord"] - p["work"] - p["rtt"] * busiest(p["jobs"], w) for p in (p1, p2)]
    if p2["b"] != p1["b"]:
        r1 = (rest[1] - rest[0]) / (p2["b"] - p1["b"])
    r0 = rest[0] - r1 * p1["b"]
    high = max(r["rtt_ms"] for r in runs)
    per_job = []
    for run in (r for r in runs if r["rtt_ms"] == high and high > low):
        p = _per_layer_step(run, shape.layers)
        excess = p["wall"] - p["coord"] - p["work"] - (r0 + r1 * p["b"])
        per_job.append(excess / (high * busiest(p["jobs"], w)))
    rtts = sum(per_job) / len(per_job) if per_job else 1.0
    return Costs(c0, c1, o_job, c_row, r0, r1, rtts_per_job=rtts, workers_parallel=1)


def check(reports: list[dict[str, Any]], costs: Costs) -> list[dict[str, Any]]:
    """Every measured window against the model: tok/s measured, modelled, error."""
    out = []
    for rep in reports:
        shape = bench_shape(rep)
        for run in rep["runs"]:
            if not run["tokens"]:
                continue
            measured_jobs = run["jobs_per_layer_token"] * run["sequences"]
            got = tok_s(shape, costs, rep["workers"], run["rtt_ms"], run["sequences"],
                        rep.get("microbatches", 1), measured_jobs)  # fmt: skip
            out.append({
                "workers": rep["workers"], "rtt_ms": run["rtt_ms"], "sequences": run["sequences"],
                "tok_s": run["tok_s"], "model_tok_s": round(got, 3),
                "error": round(got / run["tok_s"] - 1, 3),
                "jobs_per_layer_step": round(run["jobs_per_layer_token"] * run["sequences"], 2),
                "model_jobs_per_layer_step": round(jobs(shape, run["sequences"]), 2),
            })  # fmt: skip
    return out


def project(
    costs: Costs, frm: Shape, shapes: list[str], workers: tuple[int, ...],
    rtts_ms: tuple[float, ...], batch: int, speedups: tuple[float, float] = (1.0, 1.0),
) -> list[dict[str, Any]]:  # fmt: skip
    """Per shape, workers and RTT: tok/s at 1 sequence and at `batch` (1 micro-batch and the
    best of 2..8), and the smallest batch whose round trips micro-batches hide."""
    out = []
    for name in shapes:
        if name not in SHAPES:
            raise RoutingError(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
        to = SHAPES[name]
        c = replace(costs.scaled(frm, to, *speedups), workers_parallel=0)  # a CPU per worker
        one = replace(c, one_rtt_per_layer=True)
        for w in workers:
            for rtt in rtts_ms:
                best_m = max(
                    range(1, min(8, batch) + 1), key=lambda m: tok_s(to, c, w, rtt, batch, m)
                )
                hide, hide1 = hiding_batch(to, c, w, rtt), hiding_batch(to, one, w, rtt)
                out.append({
                    "shape": name, "workers": w, "rtt_ms": rtt,
                    "tok_s_b1": round(tok_s(to, c, w, rtt, 1), 3),
                    f"tok_s_b{batch}": round(tok_s(to, c, w, rtt, batch), 3),
                    f"tok_s_b{batch}_best_m": round(tok_s(to, c, w, rtt, batch, best_m), 3),
                    "best_m": best_m,
                    f"tok_s_b{batch}_one_rtt": round(tok_s(to, one, w, rtt, batch, best_m), 3),
                    "hidden_at": _at(hide), "hidden_at_one_rtt": _at(hide1),
                })  # fmt: skip
    return out


def _at(hide: tuple[int, int] | None) -> dict[str, int] | None:
    return None if hide is None else {"batch": hide[0], "microbatches": hide[1]}


def throughput_report(
    reports: list[dict[str, Any]], shapes: list[str], workers: tuple[int, ...],
    rtts_ms: tuple[float, ...], batch: int, speedups: tuple[float, float] = (1.0, 1.0),
) -> dict[str, Any]:  # fmt: skip
    """Calibrated from the first report; checked against all; projected with the coordinator
    and the workers `speedups` times as fast as the bench's CPUs."""
    if not reports:
        raise RoutingError("--throughput needs at least one --measured bench report")
    if min(speedups) <= 0:
        raise RoutingError(f"--coord-speedup and --worker-speedup must be > 0, got {speedups}")
    costs = calibrate(reports[0])
    checks = check(reports, costs)
    errors = [abs(c["error"]) for c in checks]
    return {
        "calibrated_from": {"workers": reports[0]["workers"], "preset": reports[0].get("preset")},
        "costs_ms": {f: round(getattr(costs, f), 4) for f in
                     ("c0", "c1", "o_job", "c_row", "r0_0", "r0_1", "rtts_per_job")},
        "check": checks, "max_abs_error": round(max(errors), 3) if errors else None,
        "speedups": {"coordinator": speedups[0], "workers": speedups[1]},
        "projection": project(costs, bench_shape(reports[0]), shapes, workers, rtts_ms, batch,
                              speedups),
    }  # fmt: skip
