"""Capacity-aware assignment of one MoE layer's slices under load (K3, issue 10 item 1).

Under load the aim is aggregate throughput: a layer is done when its slowest node is done, so
each layer's active slices go to the nodes that make that finish time smallest. A node's finish
time is the time its own part of the layer takes:

- the coordinator: `rows x ms_per_row` summed over the slices it keeps (it computes them while
  the remote jobs are in flight, so its overhead is 0);
- a worker: `overhead_ms + rows x ms_per_row` over the slices sent to it (its jobs go out
  together, so the round trip is paid once per layer).

Estimates are EWMAs per node, fed by what dispatch measures: the coordinator's local compute
time per row, and per result a worker's `compute_ms / rows` and `latency - compute_ms` (the
round trip, queueing and serialisation). A worker with no sample yet is priced at the
coordinator's rate plus `prior_overhead_ms` (H4's 50 ms): its trial or re-probe measures it.

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

Rate = Callable[[str], float]  # node -> ms per row, or node -> overhead ms
_MAX_ROUNDS = 8  # improvement rounds per layer (each O(slices^2) makespans with chains)
_CHAIN_MAX_SLICES = 16  # above this many active slices, only single moves (time per layer)


@dataclass(slots=True)
class _Estimate:
    ms_per_row: float | None = None
    overhead_ms: float | None = None


class Capacity:
    """Per-node compute-rate and overhead estimates, and the layer assignment they imply."""

    def __init__(
        self, coordinator: str, alpha: float = 0.3, prior_overhead_ms: float = 50.0,
        prior_ms_per_row: float = 0.1,
    ) -> None:  # fmt: skip
        self.coordinator, self.alpha = coordinator, alpha
        self.prior_overhead_ms, self.prior_ms_per_row = prior_overhead_ms, prior_ms_per_row
        self._est: dict[str, _Estimate] = {coordinator: _Estimate(overhead_ms=0.0)}

    def observe_local(self, rows: int, ms: float) -> None:
        """The coordinator computed `rows` token rows of a slice in `ms`."""
        self._blend(self.coordinator, rows, ms, None)

    def observe_remote(self, worker: str, rows: int, latency_ms: float, compute_ms: float) -> None:
        """A worker's result: `latency_ms` from send to arrival, `compute_ms` of it computing."""
        compute = min(max(0.0, compute_ms), latency_ms)
        self._blend(worker, rows, compute, latency_ms - compute)

    def forget(self, worker: str) -> None:
        self._est.pop(worker, None)

    def ms_per_row(self, node: str) -> float:
        e = self._est.get(node)
        if e is not None and e.ms_per_row is not None:
            return e.ms_per_row
        own = self._est[self.coordinator].ms_per_row
        return own if own is not None else self.prior_ms_per_row

    def overhead_ms(self, node: str) -> float:
        if node == self.coordinator:
            return 0.0
        e = self._est.get(node)
        return (
            e.overhead_ms if e is not None and e.overhead_ms is not None else self.prior_overhead_ms
        )

    def assign(
        self, work: Mapping[str, int], candidates: Mapping[str, Sequence[str]]
    ) -> dict[str, str]:
        return assign(work, candidates, self.ms_per_row, self.overhead_ms)

    def describe(self) -> dict[str, dict[str, float]]:
        return {
            n: {"ms_per_row": round(self.ms_per_row(n), 4), "overhead_ms": round(self.overhead_ms(n), 3)}
            for n in sorted(self._est)
        }  # fmt: skip

    def _blend(self, node: str, rows: int, compute_ms: float, overhead_ms: float | None) -> None:
        if rows <= 0 or not math.isfinite(compute_ms):
            return
        e = self._est.setdefault(node, _Estimate())
        rate = compute_ms / rows
        a = self.alpha
        e.ms_per_row = rate if e.ms_per_row is None else e.ms_per_row + a * (rate - e.ms_per_row)
        if overhead_ms is not None and math.isfinite(overhead_ms):
            o = e.overhead_ms
            e.overhead_ms = overhead_ms if o is None else o + a * (overhead_ms - o)


def finish_times(
    assignment: Mapping[str, str], work: Mapping[str, int], ms_per_row: Rate, overhead_ms: Rate
) -> dict[str, float]:
    """Each used node's finish time for this layer under `assignment` (slice -> node)."""
    out: dict[str, float] = {}
    for sid, node in assignment.items():
        start = out.get(node, overhead_ms(node))
        out[node] = start + work[sid] * ms_per_row(node)
    return out


def makespan(
    assignment: Mapping[str, str], work: Mapping[str, int], ms_per_row: Rate, overhead_ms: Rate
) -> float:
    """The layer's finish time: its slowest node's."""
    return max(finish_times(assignment, work, ms_per_row, overhead_ms).values(), default=0.0)


def assign(
    work: Mapping[str, int], candidates: Mapping[str, Sequence[str]], ms_per_row: Rate,
    overhead_ms: Rate,
) -> dict[str, str]:  # fmt: skip
    """slice -> node for every slice in `work` (rows per slice), each on one of its
    `candidates` (in preference order: the first wins ties). Greedy longest-first, then moves
    and swaps off the slowest node while they shorten the layer."""
    finish: dict[str, float] = {}
    out: dict[str, str] = {}
    for sid in sorted(work, key=lambda s: (-work[s], s)):
        best, best_t = "", math.inf
        for node in candidates[sid]:
            t = finish.get(node, overhead_ms(node)) + work[sid] * ms_per_row(node)
            if t < best_t:
                best, best_t = node, t
        out[sid] = best
        finish[best] = best_t
    chains = len(out) <= _CHAIN_MAX_SLICES
    for _ in range(min(_MAX_ROUNDS, 2 * len(out))):
        if not _improve(out, work, candidates, ms_per_row, overhead_ms, chains):
            break
    return out


def _improve(
    out: dict[str, str], work: Mapping[str, int], candidates: Mapping[str, Sequence[str]],
    ms_per_row: Rate, overhead_ms: Rate, chains: bool,
) -> bool:  # fmt: skip
    """Applies the change that shortens the layer most among: one slice off the slowest node
    to another, plus at most one slice of that node moved on (a swap, or a chain of two);
    False if none does."""
    now = makespan(out, work, ms_per_row, overhead_ms)
    finish = finish_times(out, work, ms_per_row, overhead_ms)
    slowest = max(finish, key=lambda n: finish[n])
    best: tuple[float, dict[str, str]] | None = None
    for sid in sorted(s for s, n in out.items() if n == slowest):
        trials: list[dict[str, str]] = []
        for node in candidates[sid]:
            if node == slowest:
                continue
            trials.append({sid: node})  # a move, or a move that makes room elsewhere:
            trials += [] if not chains else [
                {sid: node, other: dest}
                for other in sorted(out)
                if out[other] == node
                for dest in candidates[other]
                if dest != node
            ]  # fmt: skip
        for change in trials:
            t = makespan({**out, **change}, work, ms_per_row, overhead_ms)
            if t < now - 1e-9 and (best is None or t < best[0]):
                best = (t, change)
    if best is None:
        return False
    out.update(best[1])
    return True
