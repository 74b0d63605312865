"""Capacity-aware assignment of one MoE layer's slices under load (K3).

Under load the aim is aggregate throughput: a layer is done when its slowest node is done, so
each layer's active slices go to the nodes that make that finish time smallest. A node's finish
time is the time its own part of the layer takes:

- the coordinator: `compute_ms(rows)` summed over the slices it keeps (it computes them while
  the remote jobs are in flight, so its overhead is 0);
- a worker: `overhead_ms + compute_ms(rows)` over the slices sent to it (its jobs go out
  together, so the round trip is paid once per layer). `overhead_ms` includes the backlog its
  last heartbeat reported from other coordinators (rows x its ms per row).

`compute_ms(rows) = fixed + per_row x rows` per node: a slice call costs a fixed part (the
experts it touches are unpacked once, whatever the rows) plus a part per row, so a plain
per-row rate would be 4x off between an 8-row decode call and a 200-row prefill. Both terms
come from an exponentially weighted least-squares fit of (rows, ms) samples, fed by what
dispatch measures: the coordinator's local compute, and per result a worker's `compute_ms`
and `latency - compute_ms` (round trip, queueing, serialisation; an EWMA). A worker with no
sample yet is priced like the coordinator plus `prior_overhead_ms` (H4's 50 ms): its trial
or re-probe measures it.

`assign` is greedy longest-first (each slice, largest first, to the node it finishes earliest
on) followed by moves of slices off the slowest node (alone, as swaps or as chains of two)
while they shorten the layer. Every
greedy step picks a node no later than keeping the slice local would, so the result is never
slower than all-local under the same estimates when the coordinator may compute every slice
(tests/coordinator/test_capacity.py, with hypothesis; it also checks a gap to the exhaustive
optimum on small cases). The router (`kvq.swarm.LiveRouter`) still decides which workers are
eligible (H3 cost, K4 proof, liveness) and handles failover (H6/H7); this module only splits
work among them (`docs/routing.md`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Compute = Callable[[str, int], float]  # (node, rows of one slice) -> ms to compute them
Overhead = Callable[[str], float]  # node -> ms its part of a layer costs besides compute
_MAX_ROUNDS = 8  # improvement rounds per layer (each O(slices^2) makespans with chains)
_CHAIN_MAX_SLICES = 16  # above this many active slices, only single moves (time per layer)


@dataclass(slots=True)
class CostFit:
    """Exponentially weighted least squares of `ms = fixed + per_row x rows`."""

    alpha: float
    n: float = 0.0  # decayed sample weight and sums
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, rows: int, ms: float) -> None:
        k = 1.0 - self.alpha
        self.n, self.sx, self.sy = k * self.n + 1, k * self.sx + rows, k * self.sy + ms
        self.sxx, self.sxy = k * self.sxx + rows * rows, k * self.sxy + rows * ms

    @property
    def empty(self) -> bool:
        return self.n == 0.0

    def terms(self) -> tuple[float, float]:
        """(fixed ms, ms per row), both >= 0; one row count seen: all of it per row."""
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return 0.0, my / mx if mx > 0 else 0.0
        slope = max(0.0, (self.sxy / self.n - mx * my) / var)
        fixed = my - slope * mx
        if fixed < 0:  # the line through 0 that fits best
            return 0.0, self.sxy / self.sxx
        return fixed, slope

    def ms(self, rows: int) -> float:
        fixed, per_row = self.terms()
        return fixed + per_row * rows


@dataclass(slots=True)
class _Estimate:
    fit: CostFit
    overhead_ms: float | None = None


class Capacity:
    """Per-node compute-cost and overhead estimates, and the layer assignment they imply."""

    def __init__(
        self,
        coordinator: str,
        alpha: float = 0.3,
        prior_overhead_ms: float = 50.0,
        prior_ms_per_row: float = 0.1,
    ) -> None:
        self.coordinator, self.alpha = coordinator, alpha
        self.prior_overhead_ms, self.prior_ms_per_row = prior_overhead_ms, prior_ms_per_row
        self._est: dict[str, _Estimate] = {coordinator: _Estimate(CostFit(alpha), 0.0)}
        self._backlog: dict[str, float] = {}  # worker -> ms of others' rows queued on it

    def observe_local(self, rows: int, ms: float) -> None:
        """The coordinator computed `rows` token rows of a slice in `ms`."""
        self._add(self.coordinator, rows, ms, None)

    def observe_remote(self, worker: str, rows: int, latency_ms: float, compute_ms: float) -> None:
        """A worker's result: `latency_ms` from send to arrival, `compute_ms` of it computing."""
        compute = min(max(0.0, compute_ms), latency_ms)
        self._add(worker, rows, compute, latency_ms - compute)

    def reset(self, worker: str) -> None:
        """Drop `worker`'s compute and overhead estimates (its backlog stays): the next
        sample sets them afresh."""
        self._est.pop(worker, None)

    def forget(self, worker: str) -> None:
        self._est.pop(worker, None)
        self._backlog.pop(worker, None)

    def set_backlog(self, worker: str, ms: float) -> None:
        """What rows queued on `worker` by others will cost before it reaches ours (its
        heartbeat, `kvq.coordinator.routing`): added to its overhead until the next beat."""
        if worker != self.coordinator and math.isfinite(ms):
            self._backlog[worker] = max(0.0, ms)

    def compute_ms(self, node: str, rows: int) -> float:
        """Estimated ms for `node` to compute `rows` rows of one slice."""
        e = self._est.get(node)
        if e is None or e.fit.empty:
            e = self._est[self.coordinator]
        return self.prior_ms_per_row * rows if e.fit.empty else e.fit.ms(rows)

    def overhead_ms(self, node: str) -> float:
        if node == self.coordinator:
            return 0.0
        e = self._est.get(node)
        base = (
            e.overhead_ms if e is not None and e.overhead_ms is not None else self.prior_overhead_ms
        )
        return base + self._backlog.get(node, 0.0)

    def assign(
        self, work: Mapping[str, int], candidates: Mapping[str, Sequence[str]]
    ) -> dict[str, str]:
        return assign(work, candidates, self.compute_ms, self.overhead_ms)

    def describe(self) -> dict[str, dict[str, float]]:
        out = {}
        for n in sorted(self._est):
            fixed, per_row = (0.0, 0.0) if self._est[n].fit.empty else self._est[n].fit.terms()
            out[n] = {
                "fixed_ms": round(fixed, 3),
                "ms_per_row": round(per_row, 4),
                "overhead_ms": round(self.overhead_ms(n), 3),
                "backlog_ms": round(self._backlog.get(n, 0.0), 3),
            }
        return out

    def _add(self, node: str, rows: int, compute_ms: float, overhead_ms: float | None) -> None:
        if rows <= 0 or not math.isfinite(compute_ms):
            return
        e = self._est.setdefault(node, _Estimate(CostFit(self.alpha)))
        e.fit.add(rows, compute_ms)
        if overhead_ms is not None and math.isfinite(overhead_ms):
            o, a = e.overhead_ms, self.alpha
            e.overhead_ms = overhead_ms if o is None else o + a * (overhead_ms - o)


def finish_times(
    assignment: Mapping[str, str],
    work: Mapping[str, int],
    compute_ms: Compute,
    overhead_ms: Overhead,
) -> dict[str, float]:
    """Each used node's finish time for this layer under `assignment` (slice -> node)."""
    out: dict[str, float] = {}
    for sid, node in assignment.items():
        start = out.get(node, overhead_ms(node))
        out[node] = start + compute_ms(node, work[sid])
    return out


def makespan(
    assignment: Mapping[str, str],
    work: Mapping[str, int],
    compute_ms: Compute,
    overhead_ms: Overhead,
) -> float:
    """The layer's finish time: its slowest node's."""
    return max(finish_times(assignment, work, compute_ms, overhead_ms).values(), default=0.0)


def assign(
    work: Mapping[str, int],
    candidates: Mapping[str, Sequence[str]],
    compute_ms: Compute,
    overhead_ms: Overhead,
) -> dict[str, str]:
    """slice -> node for every slice in `work` (rows per slice), each on one of its
    `candidates` (in preference order: the first wins ties). Greedy longest-first, then moves
    and swaps off the slowest node while they shorten the layer."""
    finish: dict[str, float] = {}
    out: dict[str, str] = {}
    for sid in sorted(work, key=lambda s: (-work[s], s)):
        best, best_t = "", math.inf
        for node in candidates[sid]:
            t = finish.get(node, overhead_ms(node)) + compute_ms(node, work[sid])
            if t < best_t:
                best, best_t = node, t
        out[sid] = best
        finish[best] = best_t
    chains = len(out) <= _CHAIN_MAX_SLICES
    for _ in range(min(_MAX_ROUNDS, 2 * len(out))):
        if not _improve(out, work, candidates, compute_ms, overhead_ms, chains):
            break
    return out


def _improve(
    out: dict[str, str],
    work: Mapping[str, int],
    candidates: Mapping[str, Sequence[str]],
    compute_ms: Compute,
    overhead_ms: Overhead,
    chains: bool,
) -> bool:
    """Applies the change that shortens the layer most among: one slice off the slowest node
    to another, plus at most one slice of that node moved on (a swap, or a chain of two);
    False if none does."""
    now = makespan(out, work, compute_ms, overhead_ms)
    finish = finish_times(out, work, compute_ms, overhead_ms)
    slowest = max(finish, key=lambda n: finish[n])
    best: tuple[float, dict[str, str]] | None = None
    for sid in sorted(s for s, n in out.items() if n == slowest):
        trials: list[dict[str, str]] = []
        for node in candidates[sid]:
            if node == slowest:
                continue
            trials.append({sid: node})  # a move, or a move that makes room elsewhere:
            trials += (
                []
                if not chains
                else [
                    {sid: node, other: dest}
                    for other in sorted(out)
                    if out[other] == node
                    for dest in candidates[other]
                    if dest != node
                ]
            )
        for change in trials:
            t = makespan({**out, **change}, work, compute_ms, overhead_ms)
            if t < now - 1e-9 and (best is None or t < best[0]):
                best = (t, change)
    if best is None:
        return False
    out.update(best[1])
    return True
