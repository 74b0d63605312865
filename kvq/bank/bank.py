"""The Bank: a node's experts, hot (device) and cold (host), with live routing counters.

    bank = Bank(slices, BankOptions.from_settings(settings), device, hist=load_hist(path))
    y = bank.forward(layer, x, ids, weights)      # as kvq.model.expert_forward, same bits
    report = bank.step()                          # once per engine step; an update every dyn_steps
    hot, cold = bank.hit_rates()

Concurrency: forwards take the bank's lock only to read the current SlotMap and to add to the
counters. A swap publishes a map without the outgoing experts, waits until no forward still
uses an older map (on CUDA its copy stream also waits for their events), copies the incoming
experts into the freed slots, and publishes a map with them whose `ready` event every later
forward's stream waits on. So compute never sees a half-applied permutation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kvq.bank.compute import check_inputs, compute, count
from kvq.bank.dynamic import PingPong, Tally, UpdateReport, decay
from kvq.bank.hist import Histogram
from kvq.bank.layout import initial_plan
from kvq.bank.numa import apply_numa_policy
from kvq.bank.options import BankOptions
from kvq.bank.planner import plan_swaps
from kvq.bank.store import LayerStore, SlotMap, choose_cold_path
from kvq.errors import BankError
from kvq.model.expert_slice import ExpertSlice

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 60.0


class Bank:
    """Experts of some layers (each an expert range) split hot/cold, planned from a histogram,
    kept on the popular experts by dynamic swaps (unless static). It logs what it chose in one
    line at `log_level` (a worker holding many slices logs its own line per slice instead)."""

    def __init__(
        self,
        slices: Iterable[ExpertSlice],
        options: BankOptions,
        device: str | torch.device = "cpu",
        *,
        hist: Histogram | None = None,
        stock_hot_bytes: int | None = None,
        log_level: int = logging.INFO,
    ) -> None:
        self.opts = options
        self.device = torch.device(device)
        self.numa = apply_numa_policy(options.numa_policy, self.device)
        sls = {sl.layer: sl for sl in slices}
        if not sls:
            raise BankError("a bank needs at least one expert slice")
        self.plan = initial_plan(sls, hist, options, self.device, stock_hot_bytes)
        self._stores = {
            layer: LayerStore(sl, self.plan.hot.get(layer, []), self.device)
            for layer, sl in sorted(sls.items())
        }
        self.cold_path, self.cold_path_note = choose_cold_path(
            self._stores.values(), options.cold_path, self.device
        )
        self._cv = threading.Condition()
        self._swap_lock = threading.Lock()
        self._copy_stream: Any = None  # CUDA: the stream host-to-device swap copies run on
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._scores = {lay: np.zeros(st.n) for lay, st in self._stores.items()}
        self._total, self._step, self._updates, self._errors = Tally(), 0, 0, 0
        self._pingpong = PingPong()
        self.swaps = 0
        log.log(
            log_level,
            "bank: %s; %s; %s; %s",
            self.describe(),
            self.plan.chosen,
            self.cold_path_note,
            self.numa,
        )

    # -- reading --------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self._stores)

    def expert_range(self, layer: int) -> tuple[int, int]:
        st = self._store(layer)
        return st.start, st.end

    def hot_set(self) -> dict[int, list[int]]:
        """Global ids of the hot experts per layer, as of now."""
        with self._cv:
            maps = {lay: st.map for lay, st in self._stores.items()}
        return {
            lay: sorted(st.start + e for e, s in enumerate(maps[lay].slot_of) if s >= 0)
            for lay, st in self._stores.items()
        }

    @property
    def hot_bytes(self) -> int:
        return sum(st.slots * st.expert_bytes for st in self._stores.values())

    @property
    def cold_bytes(self) -> int:
        return sum(st.n * st.cold_expert_bytes for st in self._stores.values())

    def describe(self) -> str:
        mode = "dynamic" if self.opts.dynamic else "static"
        return (
            f"{mode}, {len(self._stores)} layers, {self.hot_bytes} hot bytes "
            f"({self.plan.covered_share:.3f} of the plan's routings) on {self.device}, "
            f"{self.cold_bytes} cold bytes on the host"
        )

    # -- compute --------------------------------------------------------------------------
    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        expert_start: int | None = None,
        expert_end: int | None = None,
    ) -> torch.Tensor:
        """Sum over each row's selected experts in `[expert_start, expert_end)` (default: all
        this bank holds of `layer`) of `w * down(silu(gate x) * up x)`; bit-identical to
        `expert_forward` over the same experts. x: [T, H]; ids: [T, k] int64; weights: [T, k].
        Counts the routed pairs on the device (no host sync beyond expert_forward's own)."""
        st = self._store(layer)
        lo, hi = self._range(st, expert_start, expert_end)
        check_inputs(st, x, ids, weights)
        inside = (ids >= lo) & (ids < hi)  # [T, k]
        m = self._enter(st, ids, inside)
        try:
            return compute(st, m, x, ids, weights, inside, lo, hi)
        finally:
            self._leave(st, m)

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Count routings without computing (traffic replays, benchmarks)."""
        st = self._store(layer)
        with self._cv:
            count(st, ids, (ids >= st.start) & (ids < st.end))

    def _enter(self, st: LayerStore, ids: torch.Tensor, inside: torch.Tensor) -> SlotMap:
        with self._cv:
            count(st, ids, inside)
            m = st.map
            st.readers[m.version] += 1
        return m

    def _leave(self, st: LayerStore, m: SlotMap) -> None:
        ev = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
        with self._cv:
            st.readers[m.version] -= 1
            if st.readers[m.version] <= 0:
                del st.readers[m.version]
            if ev is not None:
                st.done[stream.stream_id] = ev
            self._cv.notify_all()

    # -- swaps ----------------------------------------------------------------------------
    def apply_swaps(self, layer: int, pairs: list[tuple[int, int]]) -> None:
        """Swap (outgoing hot, incoming cold) global expert ids of one layer, safely while
        other threads run forwards (see the module docstring)."""
        st = self._store(layer)
        with self._swap_lock:
            with self._cv:
                jobs = st.unmap_outgoing(pairs)
                if not self._cv.wait_for(st.drained, timeout=DRAIN_TIMEOUT_S):
                    outs = [o - st.start for o, _ in pairs]
                    back = [(slot, o) for (slot, _), o in zip(jobs, outs, strict=True)]
                    st.map_incoming(back, None)  # slots untouched: the outgoing stay hot
                    raise BankError(
                        f"layer {layer}: forwards did not finish within "
                        f"{DRAIN_TIMEOUT_S}s; swap abandoned"
                    )
                waits = list(st.done.values())
                st.done.clear()
            ready = st.copy_in(jobs, waits, self._copy_stream)
            with self._cv:
                st.map_incoming(jobs, ready)
            self.swaps += len(pairs)

    # -- dynamic updates ----------------------------------------------------------------
    def step(self, n: int = 1) -> UpdateReport | None:
        """Advance the engine step count; every `dyn_steps` steps, evaluate the counters (and
        in dynamic mode swap). Returns the update's report, else None."""
        self._step += n
        if self._step < (self._updates + 1) * self.opts.dyn_steps:
            return None
        return self.update()

    def update(self) -> UpdateReport:
        """Evaluate the counters since the last update now; swap if dynamic; log one line."""
        self._updates += 1
        windows, maps = self._take_windows()
        tally = Tally()
        for layer, counts in windows.items():
            st = self._stores[layer]
            tally.add(counts, maps[layer].hot_mask(), st.expert_bytes)
            decay(self._scores[layer], counts)
        self._total = self._total.merged(tally)
        swaps = self._swap_all(maps) if self.opts.dynamic else 0
        mode = "dynamic" if self.opts.dynamic else "static"
        report = UpdateReport(
            self._step, self._updates, mode, swaps, tally.rates(), self._pingpong.total
        )
        log.info("%s", report.line())
        return report

    def _swap_all(self, maps: dict[int, SlotMap]) -> int:
        """Plan every layer's swaps with the shared planner, then apply them. Planner errors
        skip the update; `max_planner_errors` in a row raise BankError (the node aborts)."""
        try:
            plans = {
                layer: plan_swaps(
                    layer,
                    self._scores[layer],
                    maps[layer].hot_mask(),
                    self.opts.dyn_max_swaps,
                    self.opts.dyn_margin,
                )
                for layer in self._stores
            }
        except BankError as exc:
            self._errors += 1
            log.error(
                "bank update %d: planner error %d of %d allowed in a row: %s",
                self._updates,
                self._errors,
                self.opts.max_planner_errors,
                exc,
            )
            if self._errors >= self.opts.max_planner_errors:
                raise BankError(f"{self._errors} planner errors in a row, aborting: {exc}") from exc
            return 0
        self._errors = 0
        done = 0
        for layer, pairs in plans.items():
            if pairs:
                st = self._stores[layer]
                self.apply_swaps(layer, [(st.start + o, st.start + i) for o, i in pairs])
                self._pingpong.record(self._updates, layer, [e for p in pairs for e in p])
                done += len(pairs)
        return done

    def _take_windows(self) -> tuple[dict[int, Any], dict[int, SlotMap]]:
        """Counters since the last update per layer (zeroed), and the maps they were counted
        under. The one host sync of an update."""
        with self._cv:
            snaps = {lay: st.counter.clone() for lay, st in self._stores.items()}
            for st in self._stores.values():
                st.counter.zero_()
            maps = {lay: st.map for lay, st in self._stores.items()}
        windows = {lay: snap[:-1].cpu().numpy() for lay, snap in snaps.items()}
        return windows, maps

    def hit_rates(self) -> tuple[float, float]:
        """(hot, cold) shares of routed pairs since start, by count (reads the device
        counters: not for the decode path)."""
        r = self.stats()["rates"]
        return r.hot, r.cold

    def stats(self) -> dict[str, Any]:
        """Totals since start: rates (HitRates), swaps, pingpong, updates, sizes, cold path."""
        with self._cv:
            peek = {lay: st.counter[:-1].clone() for lay, st in self._stores.items()}
            maps = {lay: st.map for lay, st in self._stores.items()}
        tally = Tally()
        for lay, counts in peek.items():
            st = self._stores[lay]
            tally.add(counts.cpu().numpy(), maps[lay].hot_mask(), st.expert_bytes)
        return {
            "rates": self._total.merged(tally).rates(),
            "swaps": self.swaps,
            "pingpong": self._pingpong.total,
            "updates": self._updates,
            "steps": self._step,
            "hot_bytes": self.hot_bytes,
            "cold_bytes": self.cold_bytes,
            "cold_path": self.cold_path,
            "mode": "dynamic" if self.opts.dynamic else "static",
        }

    # -- helpers ------------------------------------------------------------------------
    def _store(self, layer: int) -> LayerStore:
        st = self._stores.get(layer)
        if st is None:
            raise BankError(f"this bank holds layers {self.layers}, not layer {layer}")
        return st

    @staticmethod
    def _range(st: LayerStore, start: int | None, end: int | None) -> tuple[int, int]:
        lo = st.start if start is None else start
        hi = st.end if end is None else end
        if not st.start <= lo < hi <= st.end:
            raise BankError(
                f"layer {st.layer}: experts [{lo}, {hi}) are not inside this "
                f"bank's [{st.start}, {st.end})"
            )
        return lo, hi
