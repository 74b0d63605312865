"""Requests their clients gave up on, read from the model's cancel stream.

Every coordinator of the model reads the whole stream (no group: a cancel concerns whichever
coordinator holds the request) from where it stood when it started, without blocking, once per
tick. Recent ids are remembered so that a request cancelled while still queued is dropped when
it is admitted.
"""

from __future__ import annotations

from collections import OrderedDict

import redis

from kvq import wire
from kvq.errors import WireError

REMEMBER = 4096  # cancelled ids kept for requests not admitted yet


class CancelFeed:
    """New cancels since the last `poll()`."""

    def __init__(self, r: redis.Redis, stream: str) -> None:
        self.r, self.stream = r, stream
        last = r.xrevrange(stream, count=1)
        self.last_id: bytes = last[0][0] if last else b"0-0"
        self.recent: OrderedDict[str, None] = OrderedDict()

    def poll(self) -> set[str]:
        """Request ids cancelled since the last poll (one non-blocking XREAD)."""
        resp = self.r.xread({self.stream: self.last_id}, count=1024)
        got: set[str] = set()
        for _, entries in resp or []:
            for eid, fields in entries:
                self.last_id = eid
                try:
                    got.add(wire.decode(fields, wire.Cancel).request_id)
                except WireError:
                    continue  # not ours to dead-letter: the stream is only a hint
        for rid in got:
            self.recent[rid] = None
        while len(self.recent) > REMEMBER:
            self.recent.popitem(last=False)
        return got

    def cancelled(self, request_id: str) -> bool:
        return request_id in self.recent
