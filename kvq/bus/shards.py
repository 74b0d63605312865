"""One consumer over a model's request shards: the same group on each of its request streams.

A model's requests are spread over `KVQ_REQUEST_SHARDS` streams, each with its own hash tag, so
that a Redis Cluster puts them on different masters (`Keys.model_requests`). Every coordinator
reads every shard through the shard's consumer group: the group hands each entry to one
coordinator, so there is no shard assignment to agree on, a coordinator that joins takes
work from every shard at once, and one that dies leaves only its pending entries behind, which
a live one claims shard by shard (`claim_from_dead`).

Reads:
- first each shard's own pending entries (a restarted coordinator finishes what it held);
- then new entries. On one server a single `XREADGROUP` names every shard and blocks on all
  of them. On a cluster one command may not name keys of several slots, and a blocking read
  waits on one node only, so each shard is read without blocking, pipelined, and polled every
  `poll_s` until `block_ms` (the same trade as `Tail._poll`).

`XREADGROUP COUNT n` over several streams returns up to n entries *per stream*: what is
delivered beyond the `count` asked for is held here and returned by the next reads. A held
entry is pending for this consumer like any entry being served, so a crash loses nothing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from kvq.bus.streams import Consumer, answer_then_ack, ensure_group, is_cluster, is_lost_key

Fields = dict[bytes, bytes]
Delivered = tuple[str, bytes, Fields]  # (stream, entry id, fields)
log = logging.getLogger("kvq.bus")
POLL_S = 0.002  # a cluster's idle coordinator polls its shards this often


class ShardedConsumer:
    """Consumer `name` of `group` on every stream of `streams` (a model's request shards)."""

    def __init__(
        self,
        r: redis.Redis,
        streams: Sequence[str],
        group: str,
        name: str,
        poll_s: float = POLL_S,
    ) -> None:
        self.r, self.group, self.name, self.poll_s = r, group, name, poll_s
        self.parts = {s: Consumer(r, s, group, name) for s in streams}
        self.streams = list(self.parts)
        self._cluster = is_cluster(r)  # asked once: `read` and `answer` are on the hot path
        self._held: deque[Delivered] = deque()

    def read(self, count: int, block_ms: int | None) -> list[Delivered]:
        """Up to `count` entries, pending ones first; `block_ms=None` returns at once when
        there are none."""
        if not self._held:
            for stream, part in self.parts.items():
                got = part.read_pending(count)
                if got:
                    return [(stream, eid, f) for eid, f in got]
            self._held.extend(self._read_new(count, block_ms))
        return [self._held.popleft() for _ in range(min(count, len(self._held)))]

    def _read_new(self, count: int, block_ms: int | None) -> list[Delivered]:
        if len(self.streams) == 1 or not self._cluster:
            return self._xreadgroup(dict.fromkeys(self.streams, ">"), count, block_ms)
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            pipe = self.r.pipeline(transaction=False)
            for stream in self.streams:
                pipe.xreadgroup(self.group, self.name, {stream: ">"}, count=count)
            try:
                resp = pipe.execute()
            except redis.ResponseError as exc:
                self._lost_group(exc)
                return []
            out = self._take([pair for got in resp for pair in got or []])
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(self.poll_s)

    def _xreadgroup(
        self, streams: dict[str, str], count: int, block: int | None
    ) -> list[Delivered]:
        try:
            resp = self.r.xreadgroup(self.group, self.name, streams, count=count, block=block)
        except redis.ResponseError as exc:
            self._lost_group(exc)
            return []
        return self._take(resp)

    def _lost_group(self, exc: redis.ResponseError) -> None:
        """A shard's stream or group vanished (Redis restarted without persistence): make
        them again and re-read pending entries from the start."""
        if not is_lost_key(exc):
            raise exc
        log.warning(
            "redis lost a request stream of %s or its group %s; made them again",
            ", ".join(self.streams),
            self.group,
        )
        for stream in self.streams:
            ensure_group(self.r, stream, self.group)
        self.reset_pending()

    def _take(self, resp: Any) -> list[Delivered]:
        out: list[Delivered] = []
        for name, entries in resp or []:
            stream = name.decode() if isinstance(name, bytes) else str(name)
            out.extend((stream, eid, f) for eid, f in entries if f)
        return out

    def ack(self, stream: str, *entry_ids: bytes) -> None:
        """Acknowledge and delete entries of one shard (see `Consumer.ack`)."""
        self.parts[stream].ack(*entry_ids)

    def answer(
        self,
        appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
        entries: Sequence[tuple[str, bytes]],
        maxlen: int,
    ) -> None:
        """Append each `(stream, fields, ttl_s)`, then ack and delete each `(shard stream,
        entry id)`, in that order (see `Consumer.answer`): one round trip on one server, two
        on a cluster, whose pipelines run per node in no order between nodes."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, eid in entries:
            by_stream.setdefault(stream, []).append(eid)
        answer_then_ack(self.r, self._cluster, self.group, appends, by_stream, maxlen)

    def reset_pending(self) -> None:
        """Re-read own pending entries of every shard at the next `read()` (after a reconnect
        or a claim); entries held back are pending too, so they are dropped here."""
        self._held.clear()
        for part in self.parts.values():
            part.reset_pending()
