"""Streams with consumer groups: bounded appends, pending-first reads, dead letters."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis

from kvq.keys import Keys

Entry = tuple[bytes, dict[bytes, bytes]]


def xadd(
    r: redis.Redis | redis.client.Pipeline, stream: str, fields: Mapping[str, Any], maxlen: int
) -> Any:
    """XADD with approximate MAXLEN trimming, so no stream grows without bound."""
    return r.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)


def ensure_group(r: redis.Redis, stream: str, group: str) -> None:
    """Create `group` on `stream` (and the stream) if missing; safe to call any time."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def dead_letter(
    r: redis.Redis,
    keys: Keys,
    source: str,
    entry_id: bytes | str,
    fields: Mapping[Any, Any],
    reason: str,
    maxlen: int,
) -> None:
    """Park an entry that cannot be processed, with the reason, on the dead-letter stream."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    out: dict[str, Any] = {"source": source, "entry_id": eid, "reason": reason[:2000]}
    for k, v in fields.items():
        name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        out[f"f.{name}"] = v
    out["ts_ms"] = int(time.time() * 1000)
    xadd(r, keys.deadletter(), out, maxlen)


class Consumer:
    """One consumer in a group: re-reads its own pending entries first, then new ones.

    Call `read()` in a loop and `ack()` each entry once its effect (a result) is written.
    A consumer that restarts under the same name thus finishes what it had taken.
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, name: str) -> None:
        self.r, self.stream, self.group, self.name = r, stream, group, name
        self._pending_done = False
        ensure_group(r, stream, group)

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries; `block_ms=None` returns at once when there are none."""
        while not self._pending_done:
            got, seen = self._read("0", count, None)
            if got:
                return got
            # a batch of only trimmed entries was acked away: look again before moving on
            self._pending_done = seen == 0
        return self._read(">", count, block_ms)[0]

    def _read(self, start: str, count: int, block_ms: int | None) -> tuple[list[Entry], int]:
        """(entries with fields, number of entries Redis returned)."""
        try:
            resp = self.r.xreadgroup(
                self.group, self.name, {self.stream: start}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # the stream or group vanished (Redis restarted without persistence)
            ensure_group(self.r, self.stream, self.group)
            self._pending_done = False
            return [], 0
        if not resp:
            return [], 0
        _, entries = resp[0]
        # a pending entry trimmed from the stream comes back without fields: drop it
        gone = [eid for eid, flds in entries if not flds]
        if gone:
            self.ack(*gone)
        return [(eid, flds) for eid, flds in entries if flds], len(entries)

    def ack(self, *entry_ids: bytes) -> None:
        if entry_ids:
            self.r.xack(self.stream, self.group, *entry_ids)

    def reset_pending(self) -> None:
        """Re-read own pending entries at the next `read()` (after a reconnect)."""
        self._pending_done = False
