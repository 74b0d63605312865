"""The dead-letter stream `P:deadletter` for operators: list, show, requeue, purge.

Every consumer parks what it cannot process there with `dead_letter` (kvq/bus/streams.py):
the source stream, the original entry id, the reason, the time, and the original fields under
`f.<name>`. Requeueing re-adds those fields to the source stream (a new entry id) and deletes
the dead letter, for use once the cause is fixed (a worker deployed, a setting corrected);
an entry that is still bad is dead-lettered again, with its reason, by whoever reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from kvq.bus.streams import xadd
from kvq.keys import Keys

FIELD_PREFIX = b"f."
RELAY_BATCH = 64  # a worker's own dead letters moved to the shared stream per pass


@dataclass(frozen=True)
class DeadLetter:
    id: str  # its entry id in P:deadletter
    source: str
    entry_id: str
    reason: str
    ts_ms: int
    fields: dict[bytes, bytes] = field(default_factory=dict)  # the original entry's fields
    worker: str = ""  # a restricted worker's, moved here by the monitor (`relay`)

    def describe(self) -> dict[str, object]:
        """JSON-friendly: field values as text where they decode, else their size."""
        shown: dict[str, object] = {}
        for k, v in self.fields.items():
            try:
                shown[k.decode()] = v.decode()
            except UnicodeDecodeError:
                shown[k.decode(errors="replace")] = f"<{len(v)} bytes>"
        return {
            "id": self.id,
            "source": self.source,
            "entry_id": self.entry_id,
            "reason": self.reason,
            "ts_ms": self.ts_ms,
            "worker": self.worker,
            "fields": shown,
        }


def _parse(eid: bytes, raw: dict[bytes, bytes]) -> DeadLetter:
    def text(name: bytes) -> str:
        return raw.get(name, b"").decode(errors="replace")

    try:
        ts = int(raw.get(b"ts_ms", b"0"))
    except ValueError:
        ts = 0
    fields = {k[len(FIELD_PREFIX) :]: v for k, v in raw.items() if k.startswith(FIELD_PREFIX)}
    return DeadLetter(
        eid.decode(),
        text(b"source"),
        text(b"entry_id"),
        text(b"reason"),
        ts,
        fields,
        text(b"worker"),
    )


def list_dead(
    r: redis.Redis, keys: Keys, count: int = 20, source: str | None = None
) -> list[DeadLetter]:
    """The newest `count` dead letters (of `source` only, if given), newest first."""
    out: list[DeadLetter] = []
    last = "+"
    while len(out) < count:
        batch = r.xrevrange(keys.deadletter(), max=last, min="-", count=max(count, 100))
        if last != "+":
            batch = batch[1:]  # the boundary entry was in the previous batch
        if not batch:
            break
        for eid, raw in batch:
            d = _parse(eid, raw)
            if source is None or d.source == source:
                out.append(d)
        last = batch[-1][0].decode()
    return out[:count]


def get_dead(r: redis.Redis, keys: Keys, dead_id: str) -> DeadLetter | None:
    got = r.xrange(keys.deadletter(), min=dead_id, max=dead_id)
    return _parse(*got[0]) if got else None


def requeue(
    r: redis.Redis, keys: Keys, dead_ids: Sequence[str], maxlen: int
) -> list[tuple[str, str]]:
    """Re-adds each dead letter's fields to its source stream and deletes it; returns
    (dead id, new entry id) per requeued entry (unknown ids and empty letters are skipped)."""
    done: list[tuple[str, str]] = []
    for dead_id in dead_ids:
        d = get_dead(r, keys, dead_id)
        if d is None or not d.source or not d.fields:
            continue
        new_id = xadd(r, d.source, d.fields, maxlen)
        r.xdel(keys.deadletter(), dead_id)
        done.append((dead_id, new_id.decode() if isinstance(new_id, bytes) else str(new_id)))
    return done


def purge(r: redis.Redis, keys: Keys, dead_ids: Sequence[str] | None = None) -> int:
    """Deletes these dead letters, or all of them (None); returns how many went."""
    if dead_ids is None:
        n = int(r.xlen(keys.deadletter()))
        r.delete(keys.deadletter())
        return n
    return int(r.xdel(keys.deadletter(), *dead_ids)) if dead_ids else 0


def relay(r: redis.Redis, keys: Keys, worker: str, maxlen: int, max_bytes: int) -> tuple[int, int]:
    """Move worker `worker`'s own dead letters (`Keys.worker_dead`, up to `RELAY_BATCH`) to
    the shared stream. Each says `worker` (its id, whatever the entry claimed) and `source` its
    inbox, the only stream its jobs come from: a requeue can put nothing anywhere else. An entry
    over `max_bytes` is dropped, not moved. Returns (moved, dropped)."""
    src = keys.worker_dead(worker)
    got = r.xrange(src, count=RELAY_BATCH)
    if not got:
        return 0, 0
    pipe = r.pipeline(transaction=False)
    moved = 0
    for _, raw in got:
        if sum(len(k) + len(v) for k, v in raw.items()) > max_bytes:
            continue
        own = {b"worker": worker.encode(), b"source": keys.worker_inbox(worker).encode()}
        xadd(pipe, keys.deadletter(), {**raw, **own}, maxlen)
        moved += 1
    pipe.execute()
    r.xdel(src, *[eid for eid, _ in got])
    return moved, len(got) - moved
