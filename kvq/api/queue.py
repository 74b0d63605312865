"""How a model's request queue moves, as the gateway sees it: what waits, what the coordinators
have taken, how fast they take it, and whether any coordinator is alive to take it.

The gateway judges a queued request by the queue's progress, not by the clock since it arrived:
a request waits while its queue moves (the coordinators' group takes entries, the coordinators
generate the tokens of the ones ahead), is 503 as soon
as no coordinator is alive, and is admitted only when the measured drain rate says it starts
within `KVQ_API_TIMEOUT_S` (else 429 with a `Retry-After` from that rate). One sample per model
is shared by every waiting call and taken at most every `SAMPLE_S` (blocking redis-py calls:
the app runs them on its thread pool).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvq.bus.redis_board import RedisBoard
from kvq.keys import COORDINATOR_GROUP

SAMPLE_S = 0.5  # a stopped coordinator is seen within this plus one read: well under 2 s
RATE_WINDOW_S = 30.0  # the drain rate is measured over this much recent backlog


def entry_key(entry: str | bytes) -> tuple[int, int]:
    """A stream entry id as a comparable pair."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class QueueSample:
    """One look at a model's request streams (all shards)."""

    t: float  # monotonic
    alive: int  # coordinators alive (fresh slot state)
    waiting: int  # entries not yet delivered to any coordinator
    delivered: int  # entries the coordinators' group has ever taken (all shards)
    tokens: int  # tokens the live coordinators have generated: the requests ahead move
    last: tuple[tuple[int, int], ...]  # per shard: the group's last delivered entry


class QueueWatch:
    """Samples of one model's queue and the drain rate measured from them."""

    def __init__(self, board: RedisBoard, model: str, streams: list[str]) -> None:
        self.board, self.model, self.streams = board, model, streams
        self._lock = threading.Lock()
        # admissions of this gateway, one at a time: each sees the ones before it queued
        self.admitting = threading.Lock()
        self._samples: deque[QueueSample] = deque()
        self._last: QueueSample | None = None

    def sample(self, fresh: bool = False) -> QueueSample:
        """The latest sample, taken anew when older than SAMPLE_S (or `fresh`)."""
        with self._lock:
            now = time.monotonic()
            if not fresh and self._last is not None and now - self._last.t < SAMPLE_S:
                return self._last
            s = self._take(now)
            self._last = s
            self._samples.append(s)
            while self._samples and now - self._samples[0].t > RATE_WINDOW_S:
                self._samples.popleft()
            return s

    def _take(self, now: float) -> QueueSample:
        pipe = self.board.r.pipeline(transaction=False)
        for s in self.streams:
            pipe.xlen(s)
            pipe.xinfo_groups(s)
        got = pipe.execute(raise_on_error=False)
        waiting = delivered = 0
        last: list[tuple[int, int]] = []
        for xlen, groups in zip(got[0::2], got[1::2], strict=True):
            if isinstance(groups, Exception) and "no such key" not in str(groups).lower():
                raise groups  # NOPERM and the like: a misconfigured gateway must say so
            g = _group(groups)
            pending = int(g.get("pending") or 0) if g else 0
            n = int(xlen) if isinstance(xlen, int) else 0
            waiting += max(0, n - pending)  # answered entries are deleted (kvq.bus.streams)
            delivered += int(g.get("entries-read") or 0) if g else 0
            last.append(entry_key(g["last-delivered-id"]) if g else (0, 0))
        alive = [c.coord for c in self.board.coordinators(self.model) if c.alive]
        tokens = 0
        for c in alive:
            stats = self.board.coord_stats(c)
            tokens += stats.tokens if stats is not None else 0
        return QueueSample(now, len(alive), waiting, delivered, tokens, tuple(last))

    def progress(self, q: QueueSample) -> int:
        """A number that grows while the queue moves: entries taken, tokens generated."""
        return q.delivered + q.tokens

    def rate(self) -> float | None:
        """Entries delivered per second while a backlog waited, over the last RATE_WINDOW_S;
        None until such a stretch was seen (an idle queue says nothing about its speed)."""
        with self._lock:
            samples = list(self._samples)
        taken, spent = 0, 0.0
        for a, b in zip(samples, samples[1:], strict=False):
            if a.waiting > 0 and b.delivered >= a.delivered:
                taken += b.delivered - a.delivered
                spent += b.t - a.t
        if spent < 2 * SAMPLE_S or taken == 0:
            return None
        return taken / spent

    def start_after_s(self, waiting: int) -> float | None:
        """When a request queued now would be taken, at the measured rate (None: unknown)."""
        rate = self.rate()
        return None if rate is None else waiting / rate

    def retry_after_s(self, waiting: int, within_s: float, max_waiting: int) -> int | None:
        """Seconds until the queue is short enough that one more request is admitted: fewer
        than `max_waiting` ahead of it, and taken within `within_s` at the measured rate.
        None when no rate is known."""
        rate = self.rate()
        if rate is None:
            return None
        room = min(max_waiting - 1, rate * within_s - 1)  # how many may wait ahead of it
        return max(1, math.ceil((waiting - room) / rate))


def _group(groups: object) -> dict[str, Any] | None:
    """The coordinators' group out of an XINFO GROUPS answer (None: not created yet)."""
    if not isinstance(groups, list):
        return None
    for g in groups:
        name = g.get("name")
        name = name.decode() if isinstance(name, bytes) else name
        if name == COORDINATOR_GROUP:
            return {k: v.decode() if isinstance(v, bytes) else v for k, v in g.items()}
    return None
