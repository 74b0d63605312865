"""Requests their clients gave up on, read from the model's cancel stream.

Every coordinator of the model reads the whole stream (no group: a cancel concerns whichever
coordinator holds the request) from where it stood when it started, without blocking, once per
tick: every entry added since, in batches, so that a storm of junk cancels delays the real ones
by a batch or so but hides none (clients trim the stream at `kvq.client.CANCEL_MAXLEN`, far
above what arrives in one tick). Recent ids are remembered so that a request cancelled while
still queued is dropped when it is admitted.
"""

from __future__ import annotations

from collections import OrderedDict

import redis

from kvq import wire
from kvq.errors import WireError

REMEMBER = 1 << 18  # cancelled ids kept for requests not admitted yet (a storm's worth)
BATCH = 4096  # entries per XREAD
MAX_PER_POLL = 250_000  # a poll reads at most this many (the rest at the next tick)


class CancelFeed:
    """New cancels since the last `poll()`."""

    def __init__(self, r: redis.Redis, stream: str) -> None:
        self.r, self.stream = r, stream
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
