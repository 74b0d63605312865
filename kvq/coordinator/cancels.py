"""Requests their clients gave up on, read from the model's cancel stream.

Every coordinator of the model reads the whole stream (no group: a cancel concerns whichever
coordinator holds the request) from where it stood when it started, without blocking, once per
tick: every entry added since, in batches, so that a storm of junk cancels delays the real ones
by a batch or so but hides none (clients trim the stream at `kvq.client.CANCEL_MAXLEN`, far
above what arrives in one tick). Recent ids are remembered so that a request cancelled while
still queued is dropped when it is admitted.

The stream is a hint: a client may trim it (`XADD ... MAXLEN 0`) faster than coordinators read
it. Each cancel also sets the request's own key (`Keys.request_cancel`), which the coordinator
reads for every request it admits and, every `CHECK_EVERY_S`, for those it is generating: one
pipelined round trip, and no other client's cancels can hide it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

import redis

from kvq import wire
from kvq.bus import cancel_keys
from kvq.errors import WireError
from kvq.keys import Keys

REMEMBER = 1 << 18  # cancelled ids kept for requests not admitted yet (a storm's worth)
BATCH = 4096  # entries per XREAD
MAX_PER_POLL = 250_000  # a poll reads at most this many (the rest at the next tick)
CHECK_EVERY_S = 0.2  # the running requests' own cancel keys are read this often


class CancelFeed:
    """New cancels since the last `poll()`."""

    def __init__(self, r: redis.Redis, stream: str, keys: Keys | None = None) -> None:
        """`keys`: read the requests' own cancel keys too (`check`, `due`)."""
        self.r, self.stream, self.keys = r, stream, keys
        self._checked = 0.0
        last = r.xrevrange(stream, count=1)
        self.last_id: bytes = last[0][0] if last else b"0-0"
        self.recent: OrderedDict[str, None] = OrderedDict()

    def poll(self) -> set[str]:
        """Request ids cancelled since the last poll (non-blocking XREADs until none is left,
        at most MAX_PER_POLL entries)."""
        got: set[str] = set()
        for _ in range(MAX_PER_POLL // BATCH):
            resp = self.r.xread({self.stream: self.last_id}, count=BATCH)
            entries = [e for _, es in resp or [] for e in es]
            for eid, fields in entries:
                self.last_id = eid
                try:
                    got.add(wire.decode(fields, wire.Cancel).request_id)
                except WireError:
                    continue  # not ours to dead-letter: the stream is only a hint
            if len(entries) < BATCH:
                break
        for rid in got:
            self.recent[rid] = None
        while len(self.recent) > REMEMBER:
            self.recent.popitem(last=False)
        return got

    def cancelled(self, request_id: str) -> bool:
        return request_id in self.recent

    def check(self, request_ids: Iterable[str]) -> set[str]:
        """Those of `request_ids` whose own cancel key is set (one pipelined round trip)."""
        return set() if self.keys is None else cancel_keys.marked(self.r, self.keys, request_ids)

    def due(self, running: Iterable[str]) -> set[str]:
        """`check` of the running requests, at most every CHECK_EVERY_S."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return set()
        self._checked = now
        return self.check(running)
