"""`kvq bench bank`: static vs dynamic hot sets on a drifting trace, and planner figures.

The trace: per layer, expert popularity is Zipf over a random ranking; each token routes to
top_k distinct experts drawn from it. Both banks start from the same hot set, planned from a
warm-up sample of the first regime (what `kvq balance collect` would record). Halfway, every
layer's ranking is shuffled. Hit rates are by count, as the banks' own update lines report them:
- `*_before`: over all update intervals before the drift;
- `*_after`: over the interval that follows the third update after the drift.
`pingpong_swaps`: experts the dynamic bank swapped out and back (or in and out) within two
updates. `planner_ms_61x256`: median time to validate and plan a 61-layer x 256-expert table
(DeepSeek-V3-sized). `greedy_gap_mixed`: the largest share of routed pairs greedy leaves to the
exact solver over random mixed-size tables.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvq.bank import Bank, BankOptions, Histogram, UpdateReport, plan_hot_set, table
from kvq.model.expert_slice import ExpertSlice

AFTER_UPDATES = 3  # *_after is measured once this many updates have seen the drifted traffic
MIB = 1 << 20


@dataclass(frozen=True)
class TraceSpec:
    """The synthetic drifting trace of `kvq bench bank`."""

    layers: int = 4
    experts: int = 64
    top_k: int = 8
    tokens_per_step: int = 32
    zipf_s: float = 1.1
    hot_share: float = 0.25  # hot experts per layer / experts
    dyn_steps: int = 100
    updates_before: int = 6
    updates_after: int = 6
    warmup_tokens: int = 4096
    seed: int = 0


def zipf_probs(rng: np.random.Generator, layers: int, experts: int, s: float) -> Any:
    """[L, E] routing probabilities: Zipf(s) over a random ranking per layer."""
    base = 1.0 / np.arange(1, experts + 1) ** s  # [E]
    base /= base.sum()
    return np.stack([base[rng.permutation(experts)] for _ in range(layers)])


def sample_routes(rng: np.random.Generator, probs: Any, tokens: int, k: int) -> Any:
    """[L, T, k] int64: k distinct experts per token, weighted by probs (Gumbel top-k)."""
    g = rng.gumbel(size=(probs.shape[0], tokens, probs.shape[1]))  # [L, T, E]
    keys = np.log(probs)[:, None, :] + g  # [L, T, E]
    return np.argpartition(-keys, k - 1, axis=-1)[..., :k].astype(np.int64)


def _banks(spec: TraceSpec, hist: Histogram) -> tuple[Bank, Bank]:
    z = torch.zeros(spec.experts, 2, 2)  # tiny experts: the trace measures hit rates only
    slices = [ExpertSlice(i, 0, spec.experts, z, z, z) for i in range(spec.layers)]
    per = 3 * 2 * 2 * 4
    budget = int(round(spec.hot_share * spec.experts)) * per * spec.layers
    out = []
    for dynamic in (False, True):
        opts = BankOptions(
            hot_bytes=budget,
            dynamic=dynamic,
            dyn_steps=spec.dyn_steps,
            numa_policy="off",
            cold_path="mapped",
        )
        out.append(Bank(slices, opts, "cpu", hist=hist))
    return out[0], out[1]


def _rate(reports: list[UpdateReport], first: int, last: int) -> float:
    """Routed-weighted hot hit rate of updates first..last (1-based, inclusive)."""
    sel = [r for r in reports if first <= r.update <= last]
    routed = sum(r.rates.routed for r in sel)
    return sum(r.rates.hot * r.rates.routed for r in sel) / routed if routed else 0.0


def run_trace(spec: TraceSpec) -> dict[str, Any]:
    """Static and dynamic hit rates before and after the drift, and ping-pong swaps."""
    if spec.updates_after < AFTER_UPDATES + 1:
        raise ValueError(f"updates_after must be >= {AFTER_UPDATES + 1}")
    rng = np.random.default_rng(spec.seed)
    before = zipf_probs(rng, spec.layers, spec.experts, spec.zipf_s)
    after = zipf_probs(rng, spec.layers, spec.experts, spec.zipf_s)
    warm = sample_routes(rng, before, spec.warmup_tokens, spec.top_k)  # [L, W, k]
    hist = Histogram(
        "bench",
        [
            table(i, np.bincount(warm[i].ravel(), minlength=spec.experts), [48] * spec.experts)
            for i in range(spec.layers)
        ],
    )
    static, dynamic = _banks(spec, hist)
    reports: dict[str, list[UpdateReport]] = {"static": [], "dynamic": []}
    drift = spec.updates_before * spec.dyn_steps
    for step in range((spec.updates_before + spec.updates_after) * spec.dyn_steps):
        routes = sample_routes(
            rng, before if step < drift else after, spec.tokens_per_step, spec.top_k
        )
        for name, bank in (("static", static), ("dynamic", dynamic)):
            for layer in range(spec.layers):
                bank.observe(layer, torch.from_numpy(routes[layer]))
            rep = bank.step()
            if rep is not None:
                reports[name].append(rep)
    ub, ua = spec.updates_before, spec.updates_before + AFTER_UPDATES + 1
    return {
        "static_before": _rate(reports["static"], 1, ub),
        "dynamic_before": _rate(reports["dynamic"], 1, ub),
        "static_after": _rate(reports["static"], ua, ua),
        "dynamic_after": _rate(reports["dynamic"], ua, ua),
        "pingpong_swaps": dynamic.stats()["pingpong"],
        "dynamic_swaps": dynamic.swaps,
        "series": {k: [round(r.rates.hot, 4) for r in v] for k, v in reports.items()},
        "drift_after_update": ub,
    }


def planner_ms(layers: int = 61, experts: int = 256, reps: int = 7, seed: int = 0) -> float:
    """Median ms to validate and plan a layers x experts table (equal sizes, 40% budget)."""
    rng = np.random.default_rng(seed)
    size = 3 * 7168 * 2048  # one DeepSeek-V3 expert at one byte per weight
    probs = zipf_probs(rng, layers, experts, 1.0)
    counts = [rng.multinomial(100_000, p).tolist() for p in probs]
    sizes = [size] * experts
    budget = int(0.4 * layers * experts * size)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan_hot_set([table(i, counts[i], sizes) for i in range(layers)], budget)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def greedy_gap_mixed(instances: int = 20, seed: int = 0) -> dict[str, float]:
    """Greedy's shortfall vs the exact solver on random mixed-size tables (8 x 32 experts,
    each layer 17, 29 or 44 MiB per expert, budget 30%): worst and mean covered share."""
    rng = np.random.default_rng(seed)
    gaps = []
    for _ in range(instances):
        probs = zipf_probs(rng, 8, 32, 1.0)
        sizes = rng.choice([17 * MIB, 29 * MIB, 44 * MIB], size=8)
        tables = [table(i, rng.multinomial(10_000, probs[i]), [sizes[i]] * 32) for i in range(8)]
        budget = int(0.3 * sum(int(t.expert_bytes.sum()) for t in tables))
        gaps.append(plan_hot_set(tables, budget).greedy_gap)
    return {"max": max(gaps), "mean": statistics.fmean(gaps)}


def run_bank_bench(spec: TraceSpec | None = None) -> dict[str, Any]:
    """Every figure of `kvq bench bank --json`."""
    spec = spec or TraceSpec()
    quiet = logging.getLogger("kvq.bank")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # one update line per bank per interval is noise here
    try:
        out = run_trace(spec)
    finally:
        quiet.setLevel(level)
    gap = greedy_gap_mixed()
    out |= {
        "planner_ms_61x256": planner_ms(),
        "greedy_gap_mixed": gap["max"],
        "greedy_gap_mixed_mean": gap["mean"],
        "trace": asdict(spec),
    }
    return out
