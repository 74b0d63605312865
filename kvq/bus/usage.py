"""What one worker's keys make Redis hold, measured in one round trip (`kvq.monitor.quota`
decides what is too much). The keys are the board's, so they are named here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from kvq.keys import WORKER_GROUP, Keys


@dataclass(frozen=True, slots=True)
class Usage:
    """What one worker's user holds now."""

    worker: str
    connections: int  # under its user
    hb_bytes: int  # MEMORY USAGE of its beat
    info_bytes: int  # ... of its record
    stream_bytes: int  # ... of its asks and every results stream measured
    entries: dict[str, int]  # stream it writes → XLEN (non-empty ones)
    consumers: int  # in its inbox's group
    written: tuple[str, ...]  # the keys it writes that hold something

    @property
    def key_bytes(self) -> int:
        return self.hb_bytes + self.info_bytes + self.stream_bytes


def measure(
    r: redis.Redis,
    keys: Keys,
    worker: str,
    coords: list[str],
    connections: int,
    found: Iterable[str] = (),
) -> Usage:
    """What `worker`'s keys hold now (its results streams to `coords`, and `found`: those of
    its results streams a sweep found, `results_streams`): one round trip, one hash tag. A key
    of another type than kvq writes counts by its memory alone."""
    hb, info = keys.worker_heartbeat(worker), keys.worker_info(worker)
    named = [keys.worker_results(worker, c) for c in coords]
    streams = [
        keys.worker_asks(worker),
        keys.worker_dead(worker),
        *named,
        *sorted(set(found) - set(named)),
    ]
    sized = [hb, info, *streams]
    pipe = r.pipeline(transaction=False)
    for k in sized:
        pipe.memory_usage(k)
    for k in streams:
        pipe.xlen(k)
    pipe.xinfo_groups(keys.worker_inbox(worker))
    got = pipe.execute(raise_on_error=False)
    mem = [v if isinstance(v, int) else 0 for v in got[: len(sized)]]
    lens = got[len(sized) : -1]
    return Usage(
        worker=worker,
        connections=connections,
        hb_bytes=mem[0],
        info_bytes=mem[1],
        stream_bytes=sum(mem[2:]),
        entries={k: n for k, n in zip(streams, lens, strict=True) if isinstance(n, int) and n},
        consumers=_consumers(got[-1]),
        written=tuple(k for k, m in zip(sized, mem, strict=True) if m),
    )


def _consumers(groups: object) -> int:
    if not isinstance(groups, list):
        return 0  # no inbox yet, or not a stream
    for g in groups:
        name = g.get("name", b"") if isinstance(g, dict) else b""
        if (name.decode() if isinstance(name, bytes) else name) == WORKER_GROUP:
            return int(g.get("consumers", 0))
    return 0


def connections_by_user(r: redis.Redis) -> dict[str, int]:
    """Open connections per ACL user name (`CLIENT LIST`)."""
    out: dict[str, int] = {}
    for c in r.client_list():
        user = c.get("user", "")
        out[user] = out.get(user, 0) + 1
    return out


def results_streams(r: redis.Redis, keys: Keys) -> dict[str, list[str]]:
    """Worker id -> every `P:{w:W}:results:*` key there is (`SCAN`, on every node of a
    cluster): a worker's user may `XADD` to a results stream for any coordinator id, even one
    that never was, and those count in its quota too."""
    out: dict[str, list[str]] = {}
    head = f"{keys.prefix}:{{w:"
    for raw in r.scan_iter(match=f"{head}*}}:results:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        worker = key[len(head) :].split("}", 1)[0]
        out.setdefault(worker, []).append(key)
    return out
