"""Where a layer's slices are computed: the router's route, and for a coordinator that holds no
routed experts (a backbone file) a live replica of each slice, waited for up to
`KVQ_REPLICA_WAIT_S` and then NoReplica, never a made-up result."""

from __future__ import annotations

import logging
import threading
import time

from kvq.bus.records import DispatchCounters
from kvq.catalog import ModelInfo
from kvq.config import DispatchSettings
from kvq.coordinator.routing import SliceRouter
from kvq.errors import NoReplica, UncoveredSlice
from kvq.slices import SliceSpec
from kvq.swarm import LiveRoute

log = logging.getLogger("kvq.coordinator")


class Placement:
    """The slices of each MoE layer, their route under the current load, and the rows routed
    to each slice (the monitor weights replica targets by them, K7)."""

    def __init__(
        self,
        routing: SliceRouter,
        info: ModelInfo,
        settings: DispatchSettings,
        has_experts: bool,
        stats: DispatchCounters,
    ) -> None:
        self.routing, self.info, self.s, self.stats = routing, info, settings, stats
        # False on a backbone file: no slice can be computed or recomputed here, so a job
        # without a live worker waits for one (`replica_for`), then fails (NoReplica)
        self.has_experts = has_experts
        self._layer_slices = {layer: info.layer_slices(layer) for layer in info.meta.moe_layers}
        self._routed: dict[str, int] = {}  # token rows per slice since the last `take_routed`
        self._routed_lock = threading.Lock()  # the slot-poll thread takes them

    def slices_of(self, layer: int) -> list[SliceSpec]:
        return self._layer_slices[layer]

    def count_routed(self, rows: dict[str, int]) -> None:
        with self._routed_lock:
            for sid, n in rows.items():
                self._routed[sid] = self._routed.get(sid, 0) + n

    def take_routed(self) -> dict[str, int]:
        """Rows routed per slice since the last call (read by the slot-poll thread)."""
        with self._routed_lock:
            out, self._routed = self._routed, {}
        return out

    def route(self, rows: dict[str, int], busy: int, total: int) -> LiveRoute | None:
        """The layer's route; None: compute it all here (coverage lost, experts held here).
        Without the experts (a backbone file), waits up to `KVQ_REPLICA_WAIT_S` for
        coverage, then raises NoReplica."""
        until = time.monotonic() + self.s.replica_wait_s
        while True:
            try:
                return self.routing.route(rows, busy, total)
            except UncoveredSlice as exc:
                if self.has_experts:
                    # admitted before coverage was lost: the weights are here, finish locally
                    self.stats.uncovered_local += 1
                    log.warning("%s; computing locally", exc)
                    return None
                if time.monotonic() >= until:
                    raise self.no_replica(str(exc)) from exc
                self._wait_coverage()

    def replica_for(self, sid: str, avoid: str | None, until: float) -> str:
        """A live worker serving `sid` for a job this coordinator cannot compute, preferring
        one other than `avoid` (the worker that just failed it); waits for one until
        `until` (monotonic), then raises NoReplica.

        Holders are reread before `avoid` is tried again (a step's view can be older than the
        worker's death), and `avoid` alone is retried only until `until`: a dead worker whose
        heartbeat has not expired yet never holds a step past the wait."""
        reread = False
        while True:
            live = self.routing.live_holders(sid)
            others = [w for w in live if w != avoid]
            if others:
                return others[0]
            if not reread:
                self.routing.refresh(force=True)
                reread = True
                continue
            if time.monotonic() >= until:
                raise self.no_replica(f"no live worker serves slice {sid}")
            if live:
                return live[0]  # only the one that just failed: once more, within the wait
            self._wait_coverage()

    def _wait_coverage(self) -> None:
        time.sleep(max(0.02, min(0.5, self.routing.refresh_s)))
        self.routing.refresh(force=True)

    def no_replica(self, why: str) -> NoReplica:
        return NoReplica(
            f"model {self.info.model!r}: {why}, and this coordinator holds no routed experts "
            f"(a backbone file) to compute it; waited {self.s.replica_wait_s:g} s "
            "(KVQ_REPLICA_WAIT_S) for a worker. Start workers (kvq worker) with room for the "
            "model's slices, then send the request again"
        )
