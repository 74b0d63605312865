"""Redis's clock, read on this host: the one clock every cross-process time in kvq is on.

A record's `ts_ms` (slot state, model state), a verdict's `until_ms`, a job's `deadline_ms` and
a result's send time are compared by another process, often on another host whose own clock
may be seconds or minutes off. So none of them is this host's `time.time()`: each is the
server's `TIME`, taken every `resync_s` and carried forward by this host's monotonic clock in
between (a monotonic clock drifts by parts per million, not by the minutes a wall clock may be
set wrong). Ages that never leave one host stay on `time.monotonic()`; TTLs and stream ids are
Redis's clock already.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

log = logging.getLogger("kvq.bus")

RESYNC_S = 60.0


def read_server_ms(r: redis.Redis, key: str) -> Callable[[], float]:
    """A reader of the server's `TIME` in ms; on a cluster, the node that serves `key` (one
    node for every role, whichever node each one would pick otherwise)."""
    cluster = hasattr(r, "get_node_from_key")

    def read() -> float:
        if cluster:
            got = r.time(target_nodes=r.get_node_from_key(key))
        else:
            got = r.time()
        sec, usec = got
        return int(sec) * 1000 + int(usec) / 1000

    return read


class ServerClock:
    """The server's clock in ms, as this host estimates it (`now_ms`).

    `read_ms` reads the server (`read_server_ms`), `monotonic` is this host's monotonic clock in
    seconds; both injectable. A read that fails keeps the last estimate; before any read has
    succeeded, this host's wall clock stands in (logged once)."""

    def __init__(
        self,
        read_ms: Callable[[], float],
        resync_s: float = RESYNC_S,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.read_ms, self.resync_s, self.monotonic, self.wall = read_ms, resync_s, monotonic, wall
        self._sync: tuple[float, float] | None = None  # (monotonic s, server ms) at a read
        self._lock = threading.Lock()
        self._warned = False

    def now_ms(self) -> float:
        sync = self._sync
        now = self.monotonic()
        if sync is None or now - sync[0] >= self.resync_s:
            sync = self._resync() or sync
        if sync is None:
            return self.wall() * 1000
        return sync[1] + (self.monotonic() - sync[0]) * 1000

    def _resync(self) -> tuple[float, float] | None:
        with self._lock:
            t0 = self.monotonic()
            try:
                server = self.read_ms()
            except redis.RedisError as exc:
                if self._sync is None and not self._warned:
                    self._warned = True
                    why = "cannot read the Redis server's clock (%s): using this host's for now"
                    log.warning(why, exc)
                return None
            t1 = self.monotonic()
            self._sync = ((t0 + t1) / 2, server)  # the server read it about half way
            return self._sync
