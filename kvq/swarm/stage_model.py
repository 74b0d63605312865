"""Decode tok/s at stage grain (X12), on paper: calibrated from `kvq bench pool --grain stage`
reports, checked against each of their windows, projected to other shapes, holder counts and
RTTs (`kvq swarm-sim --throughput` with stage reports).

One engine step takes B sequences, cut into m cohorts of b = B/m (`KVQ_MICROBATCHES`), through
a chain of H holders, each holding L/H of the model's L blocks. Per pass of one cohort:

    coordinator   C(b) = h0 + h1 b                    (embedding, head, sampling, the loop)
    a holder      P(b) = (L/H) (l0 + l1 b)            (its blocks over b rows)
    a hop         hop0 + rtts RTT                     (Redis, wake-ups, encoding; the link)

A cohort's pass takes C(b) + H (hop0 + rtts RTT) + H P(b); with m cohorts in flight the step
takes, in steady state,

    T = max(C(b) + H (hop0 + rtts RTT) + H P(b),  m C(b),  m P(b) x (H if the holders share
                                                                    one CPU, else 1))

and tok/s = B / T. The round trips are hidden once the busiest machine's term is the largest.

Calibration (per step of a window, steps = tokens / B): the coordinator's part is the wall time
less its wait (`remote_wait_s`); the holders' part is their CPU time (one CPU in the bench: it
is the sum over holders); the rest is the hops, `J` of them per step (`remote_sent` / steps:
jobs per step, consecutive spans on one holder being one job). Each is a least-squares fit of
relative errors with no coefficient below 0. Projection scales the holders' costs by the active
parameters of a block (weights read per token dominate a decode pass) and the coordinator's by
the head's (vocabulary x hidden), on CPUs like the bench's unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvq.errors import RoutingError
from kvq.swarm.fit import fit as _fit


@dataclass(frozen=True, slots=True)
class StageShape:
    """What the stage costs depend on: blocks, active parameters per block, head size."""

    name: str
    layers: int
    block_params: (
        float  # parameters one token reads per block: attention, router, k experts, shared
    )
    head_params: float  # vocabulary x hidden


def moe_block_params(
    hidden: int, attention: float, experts: int, used: int, expert_ffn: int, shared_ffn: int = 0
) -> float:
    return attention + hidden * experts + 3 * hidden * expert_ffn * used + 3 * hidden * shared_ffn


STAGE_SHAPES = {
    # 94 blocks: GQA 64 heads / 4 KV heads of 128, 128 experts top-8 of 1536
    "qwen3-235b-a22b": StageShape(
        "qwen3-235b-a22b",
        94,
        moe_block_params(4096, 2 * 4096 * 64 * 128 + 2 * 4096 * 4 * 128, 128, 8, 1536),
        151936 * 4096,
    ),
    # 61 blocks (3 dense, their FFN 18432 spread over the MoE ones), MLA (~187 M), 256 experts
    # top-8 of 2048 and one shared of 2048; Kimi-K2 has the same block (384 experts, 64 heads)
    "deepseek-v3": StageShape(
        "deepseek-v3",
        61,
        moe_block_params(7168, 187.1e6 + 3 * 3 * 7168 * 18432 / 58, 256, 8, 2048, 2048),
        129280 * 7168,
    ),
}


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Milliseconds on the calibrating machine (see the module docstring)."""

    h0: float
    h1: float
    l0: float
    l1: float
    hop0: float
    rtts: float = 1.0
    shared_cpu: bool = True  # the holders compute on one CPU (the bench); False: one each

    def scaled(self, frm: StageShape, to: StageShape, speedup: float = 1.0) -> StageCosts:
        kb = to.block_params / frm.block_params / speedup
        kh = to.head_params / frm.head_params / speedup
        return replace(
            self,
            h0=self.h0 * kh,
            h1=self.h1 * kh,
            l0=self.l0 * kb,
            l1=self.l1 * kb,
            shared_cpu=False,
        )


def step_ms(
    shape: StageShape,
    c: StageCosts,
    holders: int,
    rtt_ms: float,
    batch: int,
    m: int = 1,
    hops: float | None = None,
) -> float:
    """Steady-state ms per engine step (`hops`: jobs per pass, when measured; else H)."""
    b = batch / m
    coord = c.h0 + c.h1 * b
    per_holder = shape.layers / holders * (c.l0 + c.l1 * b)
    h = holders if hops is None else hops
    chain = coord + h * (c.hop0 + c.rtts * rtt_ms) + holders * per_holder
    busiest = m * per_holder * (holders if c.shared_cpu else 1)
    return max(chain, m * coord, busiest)


def tok_s(
    shape: StageShape,
    c: StageCosts,
    holders: int,
    rtt_ms: float,
    batch: int,
    m: int = 1,
    hops: float | None = None,
) -> float:
    return 1000 * batch / step_ms(shape, c, holders, rtt_ms, batch, m, hops)


def bench_stage_shape(report: dict[str, Any]) -> StageShape:
    s = report["shape"]
    attention = (
        2 * s["hidden"] * s["heads"] * s["head_dim"]
        + 2 * s["hidden"] * s["kv_heads"] * s["head_dim"]
    )
    return StageShape(
        report.get("preset") or "bench",
        s.get("blocks", s["layers"]),
        moe_block_params(s["hidden"], attention, s["experts"], s["experts_used"], s["expert_ffn"]),
        float(s.get("vocab", 50304)) * s["hidden"],
    )


def _points(reports: list[dict[str, Any]]) -> list[dict[str, float]]:
    out = []
    for rep in reports:
        m = rep.get("microbatches", 1)
        for run in rep["runs"]:
            if not run.get("tokens"):
                continue
            b = run["sequences"]
            steps = run["tokens"] / b
            wall = 1000 * run["window_s"] / steps
            spans = rep["slices"]  # the bench's per-"layer" figures are per span here
            wait = run["wait_ms_per_layer_token"] * b * spans
            out.append(
                {
                    "b": b / m,
                    "m": m,
                    "wall": wall,
                    "coord": max(0.0, wall - wait),
                    "work": 1000 * run["workers_cpu_s"] / steps / m,
                    "hops": run["jobs_per_layer_token"] * b * spans / m,
                    "rtt": run["rtt_ms"],
                    "layers": rep["shape"].get("blocks", rep["shape"]["layers"]),
                }
            )
    return out


def calibrate_stages(reports: list[dict[str, Any]]) -> StageCosts:
    """Costs from stage bench reports, jointly (see the module docstring)."""
    pts = _points(reports)
    if not pts:
        raise RoutingError("the stage bench reports have no window with tokens")
    walls = [p["wall"] for p in pts]
    h0, h1 = _fit([[1.0, p["b"]] for p in pts], [p["coord"] for p in pts], walls)
    l0, l1 = _fit(
        [[p["layers"], p["layers"] * p["b"]] for p in pts], [p["work"] for p in pts], walls
    )
    rest = [p["wall"] - p["coord"] - p["m"] * p["work"] for p in pts]
    hop0, rtts = _fit([[p["hops"], p["hops"] * p["rtt"]] for p in pts], rest, walls)
    return StageCosts(h0, h1, l0, l1, hop0, rtts, shared_cpu=True)


def stage_report(
    reports: list[dict[str, Any]],
    shapes: list[str],
    holders: tuple[int, ...],
    rtts_ms: tuple[float, ...],
    batch: int,
    speedup: float = 1.0,
) -> dict[str, Any]:
    """Calibrated from every stage report, checked against each window, projected."""
    costs = calibrate_stages(reports)
    frm = bench_stage_shape(reports[0])
    checks = []
    for rep in reports:
        for run, p in zip([r for r in rep["runs"] if r.get("tokens")], _points([rep]), strict=True):
            h = max(1, round(p["hops"]))  # the holders a pass went through (one CPU here)
            got = tok_s(frm, costs, h, run["rtt_ms"], run["sequences"], int(p["m"]), p["hops"])
            checks.append(
                {
                    "rtt_ms": run["rtt_ms"],
                    "sequences": run["sequences"],
                    "tok_s": run["tok_s"],
                    "model_tok_s": round(got, 3),
                    "error": round(got / run["tok_s"] - 1, 3),
                }
            )
    out = []
    for name in shapes:
        if name not in STAGE_SHAPES:
            raise RoutingError(f"unknown shape {name!r}; choose from {sorted(STAGE_SHAPES)}")
        to = STAGE_SHAPES[name]
        c = costs.scaled(frm, to, speedup)
        one = replace(c, rtts=1.0)  # what if a hop cost one RTT, as the link allows
        for h in holders:
            for rtt in rtts_ms:
                best = max(range(1, h + 2), key=lambda m: tok_s(to, c, h, rtt, batch, m))
                out.append(
                    {
                        "shape": name,
                        "holders": h,
                        "rtt_ms": rtt,
                        "tok_s_b1": round(tok_s(to, c, h, rtt, 1), 3),
                        "tok_s_b1_one_rtt": round(tok_s(to, one, h, rtt, 1), 3),
                        f"tok_s_b{batch}": round(tok_s(to, c, h, rtt, batch), 3),
                        f"tok_s_b{batch}_cohorts": round(tok_s(to, c, h, rtt, batch, best), 3),
                        "cohorts": best,
                    }
                )
    errors = [abs(c["error"]) for c in checks]
    fields = ("h0", "h1", "l0", "l1", "hop0", "rtts")
    return {
        "grain": "stage",
        "costs_ms": {f: round(getattr(costs, f), 4) for f in fields},
        "check": checks,
        "max_abs_error": round(max(errors), 3) if errors else None,
        "speedup": speedup,
        "projection": out,
    }
