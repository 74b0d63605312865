"""Workers that stopped holding slices, for the operators' view (`P:departed`, an hour): the
monitor reaped them (no heartbeat), took their slices (quarantined), or they gave their
slices back themselves (a clean stop, a wind-down)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from kvq.bus.board import Board
from kvq.bus.records import Departure
from kvq.monitor.coverage import sid_ranges

Held = list[tuple[str, str]]  # (model, slice id)s of one worker


def departure(board: Board, held: Held, why: str) -> Departure:
    """Now, `why`, and what it held (per model: its slice count and ranges)."""
    per: dict[str, list[str]] = {}
    for m, sid in held:
        per.setdefault(m, []).append(sid)
    what = "; ".join(
        f"{m}: {len(sids)} slice(s), {' '.join(sid_ranges(sids))}"
        for m, sids in sorted(per.items())
    )
    return Departure(ts_ms=int(board.now_ms()), why=why, held=what)


def reaped_why(board: Board) -> str:
    ttl = board.lifetimes.heartbeat_ms() / 1000
    return f"lost: no heartbeat for {ttl:g}s (KVQ_HEARTBEAT_TTL_S); reaped"


class Watch:
    """Who held what at the active monitor's last tick; records who holds nothing since."""

    def __init__(self, gap_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.gap_s, self.clock = gap_s, clock  # longer between ticks: start over (a standby)
        self.held: dict[str, Held] = {}
        self.at: float | None = None

    def update(
        self,
        board: Board,
        models: Collection[str],
        reaped: Collection[str],
        barred: Collection[str],
        operators: Mapping[str, str] | None = None,
        drained: Collection[str] = (),
    ) -> list[str]:
        """After a tick's reap and releases: record the workers that held slices at the last
        tick and hold none now (the reaped ones are recorded by the reap; `drained`: those an
        operator drained, which give their slices back themselves); those workers."""
        now: dict[str, Held] = {}
        for m in models:
            for w, sids in board.assignments(m).items():
                now.setdefault(w, []).extend((m, s) for s in sids)
        t = self.clock()
        fresh = self.at is not None and t - self.at <= self.gap_s
        gone = [w for w in self.held if w not in now and w not in reaped] if fresh else []
        by = operators or {}
        for w in gone:
            why = (
                f"quarantined by operator {by[w]}: its slices taken back"
                if w in barred and w in by
                else "quarantined: its slices taken back (wrong results)"
                if w in barred
                else f"drained by operator {by.get(w, '?')}: its slices taken back once its "
                "work was done"
                if w in drained
                else "left: gave its slices back (a clean stop or a wind-down)"
            )
            board.record_departure(w, departure(board, self.held[w], why))
        self.held, self.at = now, t
        return gone
