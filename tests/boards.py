"""One board per test on each implementation: `MemoryBoard` and `RedisBoard` on a real server.

Role-logic tests take the `board_case` fixture and run twice. The few things a test must do
behind a role's back (a worker's heartbeat expiring, a coordinator's slot state vanishing,
reading an inbox) are written here once per implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvq.bus.board import Board
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import Lifetimes
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings


@dataclass
class BoardCase:
    board: Board

    def kill_worker(self, worker: str) -> None:
        """The worker's heartbeat expires (it died without leaving)."""
        b = self.board
        if isinstance(b, RedisBoard):
            b.r.delete(b.keys.worker_heartbeat(worker))
        else:
            assert isinstance(b, MemoryBoard)
            b.lapse("hb", worker)

    def vanish_coordinator(self, coord: str) -> None:
        """The coordinator's slot state expires (it stopped long ago)."""
        b = self.board
        if isinstance(b, RedisBoard):
            b.r.delete(b.keys.coord_slots(coord))
        else:
            assert isinstance(b, MemoryBoard)
            b.lapse("slots", coord)

    def inbox(self, worker: str) -> list[dict[str, Any]]:
        """The worker's inbox entries' fields, as str → str."""
        b = self.board
        if isinstance(b, RedisBoard):
            rows = [f for _, f in b.r.xrange(b.keys.worker_inbox(worker))]
        else:
            assert isinstance(b, MemoryBoard)
            rows = list(b.inboxes.get(worker, []))
        return [{_s(k): _s(v) for k, v in f.items()} for f in rows]


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def lifetimes_of(settings: Settings) -> Lifetimes:
    return settings.lifetimes


def make_case(
    request: pytest.FixtureRequest, kind: str, lifetimes: Lifetimes | None = None
) -> BoardCase:
    """A `kind` ("memory" or "redis") board; `lifetimes` replaces the test settings' TTL rules
    (a short heartbeat for tests that watch one expire)."""
    if kind == "memory":
        return BoardCase(MemoryBoard(lifetimes or Lifetimes(1.0, 10.0, 600)))
    settings: Settings = request.getfixturevalue("settings")
    board = open_board(settings.bus, lifetimes or settings.lifetimes)
    request.addfinalizer(board.r.close)
    return BoardCase(board)
