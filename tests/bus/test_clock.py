"""`ServerClock`: Redis's clock read on this host, whatever this host's own clock says."""

from __future__ import annotations

import redis

from kvq.bus.clock import ServerClock, read_server_ms
from kvq.bus.redis_board import open_board
from kvq.config import Settings


class _Fake:
    def __init__(self) -> None:
        self.mono, self.server_ms, self.reads, self.down = 100.0, 5_000_000.0, 0, False

    def read(self) -> float:
        if self.down:
            raise redis.ConnectionError("down")
        self.reads += 1
        return self.server_ms


def test_it_reads_the_server_once_per_resync_and_carries_it_forward() -> None:
    f = _Fake()
    clock = ServerClock(f.read, resync_s=60, monotonic=lambda: f.mono, wall=lambda: 0.0)
    assert clock.now_ms() == 5_000_000.0 and f.reads == 1
    f.mono += 10  # 10 s on this host's monotonic clock
    assert clock.now_ms() == 5_010_000.0 and f.reads == 1
    f.mono += 50
    f.server_ms = 7_000_000.0  # the server's clock was set meanwhile: taken at the resync
    assert clock.now_ms() == 7_000_000.0 and f.reads == 2


def test_an_outage_keeps_the_last_reading_and_the_wall_clock_stands_in_before_any() -> None:
    f = _Fake()
    f.down = True
    clock = ServerClock(f.read, resync_s=1, monotonic=lambda: f.mono, wall=lambda: 42.0)
    assert clock.now_ms() == 42_000.0
    f.down = False
    assert clock.now_ms() == 5_000_000.0
    f.down, f.mono = True, f.mono + 5
    assert clock.now_ms() == 5_005_000.0


def test_a_redis_board_is_on_the_servers_clock(settings: Settings) -> None:
    board = open_board(settings.bus, settings.lifetimes)
    server = read_server_ms(board.r, board.keys.models())
    before = server()
    got = board.now_ms()
    after = server()
    assert before - 50 <= got <= after + 50
