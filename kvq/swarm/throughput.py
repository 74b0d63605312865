"""Decode tok/s of a backbone-only coordinator and W workers, on paper.

One engine step runs B sequences through L MoE layers. Each layer: the coordinator computes its
part (attention, router; `C(b) = c0 + c1 * b` ms for b sequences), sends one job per slice the
b x k routed rows touch, and waits `D` for the results: a fixed `r0(b)` (Redis, wake-ups),
`r_contact` per worker reached beyond the first, `rtts_fixed + rtts_per_job x J_busiest +
rtts_contact x (reached - 1)` RTTs (J_busiest: the busiest worker's jobs; a worker answers all
of a layer's jobs it read together; a layer waits for the slowest of the workers it reached),
and the busiest worker's compute (`o_job` per job + `c_row` per row).
With m micro-batches (strict round robin, as `forward_microbatched` drives them) each of
b = B/m sequences, a layer takes, in steady state,

    T = max(m * C(b),  C(b) + D(b),  m * W(b))     (coordinator, one micro-batch's own loop,
                                                    the busiest worker)

and tok/s = B / (L x T). The round trips are hidden when the middle term is not the largest:
`hiding_batch` finds the smallest B where it is. `simulate_period` plays the same schedule
event by event (the brute force the tests hold the formula to).

Assumptions (stated in docs/routing.md): decode only (prefill folded into the calibrated
costs); rows spread uniformly over experts; a job per slice touched (`S(1 - (1 - 1/S)^(b k))`
jobs of S slices per layer); the busiest of W workers gets the expected maximum of uniform
balls in bins (mean + sqrt(2 mean ln W)); `workers_parallel` = the workers' CPUs (1 in the
bench: they share one); costs scale to another shape by parameter count (coordinator: the
backbone's parameters per layer; workers: hidden x expert FFN), on CPUs like the bench's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class Shape:
    """The model figures the costs depend on."""

    name: str
    layers: int  # MoE layers (dense leading layers are folded into backbone_params)
    experts: int
    experts_used: int
    hidden: int
    expert_ffn: int
    slices_per_layer: int
    backbone_params: float  # coordinator parameters per MoE layer (attention, router, shared)


def gqa_params(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int) -> float:
    """Attention and router parameters of one grouped-query layer."""
    return float(
        2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + hidden * experts
    )


SHAPES = {
    "qwen3-235b-a22b": Shape(
        "qwen3-235b-a22b", 94, 128, 8, 4096, 1536, 32, gqa_params(4096, 64, 4, 128, 128)
    ),
    # 61 layers, 3 dense (their FFNs spread over the 58 MoE layers), MLA attention (q_lora
    # 1536, kv_lora 512, 128 heads of 128+64 / 128), one shared expert of 2048
    "deepseek-v3": Shape(
        "deepseek-v3",
        58,
        256,
        8,
        7168,
        2048,
        64,
        187.1e6 + 7168 * 256 + 3 * 7168 * 2048 + 3 * 3 * 7168 * 18432 / 58,
    ),
}


@dataclass(frozen=True, slots=True)
class Costs:
    """Milliseconds on the calibrating machine (see the module docstring)."""

    c0: float  # coordinator, per layer per micro-batch pass
    c1: float  # coordinator, per layer per sequence
    o_job: float  # a worker, per job
    c_row: float  # a worker, per routed row
    r0_0: float  # fixed latency per layer: r0(b) = r0_0 + r0_1 * b
    r0_1: float = 0.0
    rtts_per_job: float = 1.0  # RTTs each job of the busiest worker adds to a layer's wait
    rtts_fixed: float = 0.0  # RTTs a layer waits whatever its jobs (sending, the first read)
    r_contact: float = 0.0  # ms per worker a layer reaches beyond the first (another wake-up)
    rtts_contact: float = 0.0  # RTTs per worker reached beyond the first (the slowest path)
    workers_parallel: int = 0  # CPUs the workers compute on; 0: one per worker
    one_rtt_per_layer: bool = False  # what if: a layer waits one RTT, however many jobs

    def scaled(
        self, frm: Shape, to: Shape, coord_speedup: float = 1.0, worker_speedup: float = 1.0
    ) -> Costs:
        """These costs for shape `to`, by parameter ratios, on a coordinator `coord_speedup`
        and workers `worker_speedup` times as fast as the calibrating machine's."""
        kc = to.backbone_params / frm.backbone_params / coord_speedup
        kw = (to.hidden * to.expert_ffn) / (frm.hidden * frm.expert_ffn) / worker_speedup
        return replace(
            self,
            c0=self.c0 * kc,
            c1=self.c1 * kc,
            c_row=self.c_row * kw,
            o_job=self.o_job / worker_speedup,
        )


def jobs(shape: Shape, b: float) -> float:
    """Expected slices one layer's b sequences touch (a job each)."""
    s = shape.slices_per_layer
    return s * (1 - float((1 - 1 / s) ** (b * shape.experts_used)))


def contacted(total: float, workers: int) -> float:
    """Expected distinct workers `total` jobs reach, each job on a uniform one of `workers`."""
    if workers <= 1 or total <= 0:
        return min(1.0, max(0.0, total)) if workers >= 1 else 0.0
    return float(workers * (1 - (1 - 1 / workers) ** total))


def busiest(total: float, workers: int) -> float:
    """Expected largest share of `total` items thrown uniformly into `workers` bins: exact
    (rounded to whole items) up to 150 items, else mean + sqrt(2 mean ln W)."""
    if workers <= 1 or total <= 0:
        return max(0.0, total)
    n = round(total)
    if n <= 64:
        return _expected_max(n, workers) * (total / n if n else 0.0)
    mean = total / workers
    return min(total, mean + math.sqrt(2 * mean * math.log(workers)))


@lru_cache(maxsize=4096)
def _expected_max(n: int, w: int) -> float:
    """E[max bin] of n balls in w bins: sum over t of P(max > t), with P(max <= t) =
    n! [y^n] (sum_{i<=t} (y/w)^i / i!)^w (the exponential generating function)."""
    if n == 0:
        return 0.0
    full = _power([(1 / w) ** i / math.factorial(i) for i in range(n + 1)], w, n)[n]
    low = -(-n // w)  # the max is at least ceil(n / w): P(max > t) = 1 below it
    total = float(low)
    for t in range(low, n):
        part = _power([(1 / w) ** i / math.factorial(i) for i in range(t + 1)], w, n)[n]
        if 1 - part / full < 1e-9:
            break
        total += 1 - part / full
    return total


def _power(p: list[float], k: int, deg: int) -> list[float]:
    """p^k truncated to degree `deg`."""
    out, base = [1.0] + [0.0] * deg, p + [0.0] * (deg + 1 - len(p))
    while k:
        if k & 1:
            out = _mul(out, base, deg)
        base, k = _mul(base, base, deg), k >> 1
    return out


def _mul(a: list[float], b: list[float], deg: int) -> list[float]:
    out = [0.0] * (deg + 1)
    for i, x in enumerate(a):
        if x:
            for j in range(deg + 1 - i):
                out[i + j] += x * b[j]
    return out


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """One micro-batch's per-layer figures, ms: coordinator, wait, busiest worker's work."""

    coord: float
    wait: float
    worker: float


def layer_times(
    shape: Shape, c: Costs, workers: int, rtt_ms: float, b: float, n_jobs: float | None = None
) -> LayerTimes:
    """`n_jobs`: jobs per layer of the b sequences, when measured (else `jobs`)."""
    par = c.workers_parallel or workers
    j, rows = jobs(shape, b) if n_jobs is None else n_jobs, b * shape.experts_used
    if par == 1:
        work = j * c.o_job + rows * c.c_row  # every worker's job on one CPU, one after another
    else:
        work = busiest(j, par) * c.o_job + busiest(rows, par) * c.c_row
    more = max(0.0, contacted(j, workers) - 1)  # workers reached beyond the first
    if c.one_rtt_per_layer:
        rtts = 1.0
    else:
        rtts = c.rtts_fixed + c.rtts_per_job * busiest(j, workers) + c.rtts_contact * more
    reach = c.r_contact * more
    wait = c.r0_0 + c.r0_1 * b + reach + rtts * rtt_ms + work
    return LayerTimes(c.c0 + c.c1 * b, wait, work)


def layer_ms(
    shape: Shape,
    c: Costs,
    workers: int,
    rtt_ms: float,
    batch: int,
    m: int = 1,
    n_jobs: float | None = None,
) -> float:
    """Steady-state ms per MoE layer per step (the formula in the module docstring)."""
    t = layer_times(shape, c, workers, rtt_ms, batch / m, n_jobs)
    return max(m * t.coord, t.coord + t.wait, m * t.worker)


def tok_s(
    shape: Shape,
    c: Costs,
    workers: int,
    rtt_ms: float,
    batch: int,
    m: int = 1,
    n_jobs: float | None = None,
) -> float:
    return 1000 * batch / (shape.layers * layer_ms(shape, c, workers, rtt_ms, batch, m, n_jobs))


def hidden(shape: Shape, c: Costs, workers: int, rtt_ms: float, batch: int, m: int) -> bool:
    """The round trips cost nothing: a layer takes as long as its busiest machine (the
    coordinator or the busiest worker) computes, not one micro-batch's loop through them."""
    t = layer_times(shape, c, workers, rtt_ms, batch / m)
    return max(m * t.coord, m * t.worker) >= t.coord + t.wait


def hiding_batch(
    shape: Shape,
    c: Costs,
    workers: int,
    rtt_ms: float,
    ms: tuple[int, ...] = (2, 4, 8),
    max_batch: int = 4096,
) -> tuple[int, int] | None:
    """The smallest (batch, micro-batches) with the round trips hidden, batch a multiple of
    m, or None up to `max_batch`."""
    best: tuple[int, int] | None = None
    for m in ms:
        for batch in range(m, max_batch + 1, m):
            if hidden(shape, c, workers, rtt_ms, batch, m):
                if best is None or batch < best[0]:
                    best = (batch, m)
                break
    return best


def simulate_period(t: LayerTimes, m: int, layers: int = 400) -> float:
    """ms per layer of m micro-batches driven round robin through `layers` layers, event by
    event: one coordinator, one worker queue (FIFO, `t.worker` per micro-batch) and a pure
    delay of `t.wait - t.worker` split evenly before and after it. The mean period over the
    second half of the run (the brute force `layer_ms` is tested against)."""
    delay = (t.wait - t.worker) / 2
    coord_free = worker_free = 0.0
    ready = [0.0] * m  # when micro-batch i's previous layer's results are back
    starts: list[float] = []  # micro-batch 0's start of each layer
    for _ in range(layers):
        for i in range(m):  # strict round robin: i waits for its own results, in order
            start = max(coord_free, ready[i])
            coord_free = start + t.coord
            done = max(coord_free + delay, worker_free) + t.worker
            worker_free = done
            ready[i] = done + delay
            if i == 0:
                starts.append(start)
    half = len(starts) // 2
    return (starts[-1] - starts[half]) / (len(starts) - 1 - half)
