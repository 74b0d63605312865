"""`kvq swarm-sim --throughput`: the throughput model calibrated from `kvq bench pool` reports,
checked against every measured window, then projected to other shapes, swarms and RTTs.

Calibration, jointly over every window of the calibrating reports (B sequences, RTT, W
workers; steps = tokens / B, L MoE layers), per layer and step:
  coordinator C = wall ms / (steps L) - its wait    = c0 + c1 B
                 (`remote_wait_s`, per layer-step; not its CPU time, which holds polling)
  workers     W = their CPU ms / (steps L)          = o_job J + c_row B k   (J: jobs per
                                                      layer-step, measured)
  the rest    R = wall ms / (steps L) - C - W       = r0_0 + r0_1 B + r_contact (reached - 1)
                                  + RTT (rtts_fixed + rtts_per_job J_busiest + rtts_contact (reached - 1))
each a least-squares fit of the windows' relative errors with no coefficient below 0 (one that
would be is dropped and the rest refitted). `reached` and `J_busiest` are the expected distinct
workers and the busiest worker's share of J jobs over the report's W workers. Reports at
different worker counts are what separate the fixed RTTs from those per job: a lone worker
reads all of a layer's jobs in one read. The check runs the model on every window of every
report, each with its measured jobs per layer (the bench's router is skewed and its windows hold
prefills: the uniform-routing count `jobs` is for the projections only); windows of reports
left out of the calibration (`calibrate`) are predictions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvq.errors import RoutingError
from kvq.swarm.fit import fit as _fit
from kvq.swarm.stage_model import stage_report
from kvq.swarm.throughput import (
    SHAPES,
    Costs,
    Shape,
    busiest,
    contacted,
    gqa_params,
    hiding_batch,
    jobs,
    tok_s,
)


def bench_shape(report: dict[str, Any]) -> Shape:
    s = report["shape"]
    return Shape(
        report.get("preset") or "bench",
        s["layers"],
        s["experts"],
        s["experts_used"],
        s["hidden"],
        s["expert_ffn"],
        s["slices_per_layer"],
        gqa_params(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["experts"]),
    )


def _per_layer_step(run: dict[str, Any], layers: int) -> dict[str, float]:
    b = run["sequences"]
    steps = run["tokens"] / b
    n = steps * layers
    wall, wait = 1000 * run["window_s"] / n, run["wait_ms_per_layer_token"] * b
    return {
        "b": b,
        "coord": wall - wait,
        "work": 1000 * run["workers_cpu_s"] / n,
        "wall": wall,
        "jobs": run["jobs_per_layer_token"] * b,
        "rtt": run["rtt_ms"],
    }


def _points(reports: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Every window with tokens, as per-layer-step figures with its report's workers and k."""
    out = []
    for rep in reports:
        shape = bench_shape(rep)
        for run in rep["runs"]:
            if run["tokens"] > 0:
                p = _per_layer_step(run, shape.layers)
                out.append({**p, "w": rep["workers"], "k": shape.experts_used})
    return out


def calibrate(reports: list[dict[str, Any]]) -> Costs:
    """Costs from bench reports, jointly (see the module docstring)."""
    pts = _points(reports)
    if not pts:
        raise RoutingError("the bench reports have no window with tokens: nothing to calibrate")
    walls = [p["wall"] for p in pts]
    c0, c1 = _fit([[1.0, p["b"]] for p in pts], [p["coord"] for p in pts], walls)
    o_job, c_row = _fit(
        [[p["jobs"], p["b"] * p["k"]] for p in pts], [p["work"] for p in pts], walls
    )
    rest = [p["wall"] - p["coord"] - p["work"] for p in pts]
    more = [max(0.0, contacted(p["jobs"], int(p["w"])) - 1) for p in pts]
    cols = [
        [1.0, p["b"], m, p["rtt"], p["rtt"] * busiest(p["jobs"], int(p["w"])), p["rtt"] * m]
        for p, m in zip(pts, more, strict=True)
    ]
    r0_0, r0_1, r_contact, fixed, per_job, per_contact = _fit(cols, rest, walls)
    return Costs(
        c0,
        c1,
        o_job,
        c_row,
        r0_0,
        r0_1,
        rtts_per_job=per_job,
        rtts_fixed=fixed,
        r_contact=r_contact,
        rtts_contact=per_contact,
        workers_parallel=1,
    )


def check(reports: list[dict[str, Any]], costs: Costs) -> list[dict[str, Any]]:
    """Every measured window against the model: tok/s measured, modelled, error."""
    out = []
    for i, rep in enumerate(reports):
        shape = bench_shape(rep)
        for run in rep["runs"]:
            if not run["tokens"]:
                continue
            measured_jobs = run["jobs_per_layer_token"] * run["sequences"]
            got = tok_s(
                shape,
                costs,
                rep["workers"],
                run["rtt_ms"],
                run["sequences"],
                rep.get("microbatches", 1),
                measured_jobs,
            )
            out.append(
                {
                    "report": i,
                    "workers": rep["workers"],
                    "rtt_ms": run["rtt_ms"],
                    "sequences": run["sequences"],
                    "tok_s": run["tok_s"],
                    "model_tok_s": round(got, 3),
                    "error": round(got / run["tok_s"] - 1, 3),
                    "jobs_per_layer_step": round(run["jobs_per_layer_token"] * run["sequences"], 2),
                    "model_jobs_per_layer_step": round(jobs(shape, run["sequences"]), 2),
                }
            )
    return out


def project(
    costs: Costs,
    frm: Shape,
    shapes: list[str],
    workers: tuple[int, ...],
    rtts_ms: tuple[float, ...],
    batch: int,
    speedups: tuple[float, float] = (1.0, 1.0),
) -> list[dict[str, Any]]:
    """Per shape, workers and RTT: tok/s at 1 sequence and at `batch` (1 micro-batch and the
    best of 2..8), and the smallest batch whose round trips micro-batches hide."""
    out = []
    for name in shapes:
        if name not in SHAPES:
            raise RoutingError(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
        to = SHAPES[name]
        # a CPU per worker, on a machine of its own: the costs of reaching several workers
        # measured here (processes sharing one CPU and one proxy host) are left out
        c = replace(
            costs.scaled(frm, to, *speedups), workers_parallel=0, r_contact=0.0, rtts_contact=0.0
        )
        one = replace(c, one_rtt_per_layer=True)
        for w in workers:
            for rtt in rtts_ms:
                best_m = max(
                    range(1, min(8, batch) + 1), key=lambda m: tok_s(to, c, w, rtt, batch, m)
                )
                hide, hide1 = hiding_batch(to, c, w, rtt), hiding_batch(to, one, w, rtt)
                out.append(
                    {
                        "shape": name,
                        "workers": w,
                        "rtt_ms": rtt,
                        "tok_s_b1": round(tok_s(to, c, w, rtt, 1), 3),
                        f"tok_s_b{batch}": round(tok_s(to, c, w, rtt, batch), 3),
                        f"tok_s_b{batch}_best_m": round(tok_s(to, c, w, rtt, batch, best_m), 3),
                        "best_m": best_m,
                        f"tok_s_b{batch}_one_rtt": round(tok_s(to, one, w, rtt, batch, best_m), 3),
                        "hidden_at": _at(hide),
                        "hidden_at_one_rtt": _at(hide1),
                    }
                )
    return out


def _at(hide: tuple[int, int] | None) -> dict[str, int] | None:
    return None if hide is None else {"batch": hide[0], "microbatches": hide[1]}


def throughput_report(
    reports: list[dict[str, Any]],
    shapes: list[str],
    workers: tuple[int, ...],
    rtts_ms: tuple[float, ...],
    batch: int,
    speedups: tuple[float, float] = (1.0, 1.0),
    calibrate_with: int = 0,
) -> dict[str, Any]:
    """Calibrated from the first `calibrate_with` reports (0: all); checked against all (the
    others' windows are predictions); projected with the coordinator and the workers
    `speedups` times as fast as the bench's CPUs."""
    if not reports:
        raise RoutingError("--throughput needs at least one --measured bench report")
    if min(speedups) <= 0:
        raise RoutingError(f"--coord-speedup and --worker-speedup must be > 0, got {speedups}")
    if not 0 <= calibrate_with <= len(reports):
        raise RoutingError(f"--calibrate {calibrate_with}: there are {len(reports)} reports")
    if all(r.get("grain") == "stage" for r in reports):
        return stage_report(reports, shapes, workers, rtts_ms, batch, speedups[1])
    if any(r.get("grain") == "stage" for r in reports):
        raise RoutingError("--measured mixes stage and expert grain reports; give one grain")
    used = reports[: calibrate_with or len(reports)]
    costs = calibrate(used)
    checks = check(reports, costs)
    for c in checks:
        c["predicted"] = c.pop("report") >= len(used)
    errors = [abs(c["error"]) for c in checks]
    fields = (
        "c0",
        "c1",
        "o_job",
        "c_row",
        "r0_0",
        "r0_1",
        "r_contact",
        "rtts_fixed",
        "rtts_per_job",
        "rtts_contact",
    )
    return {
        "calibrated_from": [{"workers": r["workers"], "preset": r.get("preset")} for r in used],
        "costs_ms": {f: round(getattr(costs, f), 4) for f in fields},
        "check": checks,
        "max_abs_error": round(max(errors), 3) if errors else None,
        "speedups": {"coordinator": speedups[0], "workers": speedups[1]},
        "projection": project(
            costs, bench_shape(reports[0]), shapes, workers, rtts_ms, batch, speedups
        ),
    }
