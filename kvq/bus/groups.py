"""What a consumer group says about its stream: lag, pending, consumers, oldest entries' ages.

Read for `/metrics` (`kvq.monitor.metrics`) with native stream commands only (`XINFO GROUPS`,
`XINFO CONSUMERS`, `XPENDING`, `XRANGE`), as redis_exporter's `--check-streams` and KEDA's
redis-streams scaler read them. Ages come from entry ids, which the server stamps with its own
clock, against the server's `TIME`: no client clock is compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from kvq.bus.streams import is_lost_key, is_wrong_type


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    name: str
    pending: int  # entries delivered to this consumer, not acknowledged
    idle_s: float  # since its last read or claim


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One group of one stream; `exists` is False until a consumer has created it."""

    exists: bool
    length: int  # XLEN
    lag: int  # entries nobody in the group has read yet
    pending: int  # delivered, not acknowledged
    oldest_pending_age_s: float | None  # age of the oldest unacknowledged entry
    oldest_unread_age_s: float | None  # age of the oldest entry nobody has read
    consumers: tuple[ConsumerStats, ...] = ()


def _id_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def _age_s(now_ms: int, entry_id: bytes | str) -> float:
    return max(0, now_ms - _id_ms(entry_id)) / 1000


def _name(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def server_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def group_stats(r: redis.Redis, stream: str, group: str, now_ms: int) -> GroupStats:
    """Stats of `group` on `stream`; see `_group_stats`. A stream or group that Redis loses
    between the calls reads as not made yet (`exists` False), not as an error, and so does a
    key of another type (a worker made its inbox one: its fault, `kvq.bus.peers`)."""
    try:
        return _group_stats(r, stream, group, now_ms)
    except redis.ResponseError as exc:
        if not (is_lost_key(exc) or is_wrong_type(exc)):
            raise
        return GroupStats(False, 0, 0, 0, None, None)


def _group_stats(r: redis.Redis, stream: str, group: str, now_ms: int) -> GroupStats:
    """Stats of `group` on `stream` (`now_ms`: the server's clock, `server_ms`).

    Without the group (no consumer started yet) every entry is unread: lag = `XLEN`. When
    Redis cannot tell the lag (`XINFO GROUPS` answers nil after some deletions) it is taken as
    `XLEN - pending`, which holds for kvq's streams since answered entries are deleted."""
    length = int(r.xlen(stream))
    info = None
    if length or r.type(stream) == b"stream":
        try:
            info = next((g for g in r.xinfo_groups(stream) if _name(g["name"]) == group), None)
        except redis.ResponseError:  # no such key
            info = None
    if info is None:
        first = r.xrange(stream, count=1) if length else []
        age = _age_s(now_ms, first[0][0]) if first else None
        return GroupStats(False, length, length, 0, None, age)
    pending = int(info["pending"])
    lag = info.get("lag")
    lag = int(lag) if lag is not None else max(0, length - pending)
    oldest_pending = None
    if pending:
        summary = r.xpending(stream, group)
        if summary.get("min"):
            oldest_pending = _age_s(now_ms, summary["min"])
    oldest_unread = None
    if lag:
        after = r.xrange(stream, min=f"({_name(info['last-delivered-id'])}", count=1)
        oldest_unread = _age_s(now_ms, after[0][0]) if after else None
    consumers = tuple(
        ConsumerStats(_name(c["name"]), int(c["pending"]), int(c["idle"]) / 1000)
        for c in r.xinfo_consumers(stream, group)
    )
    return GroupStats(True, length, lag, pending, oldest_pending, oldest_unread, consumers)


def merged(parts: list[GroupStats]) -> GroupStats:
    """The stats of one group over several streams (a model's request shards) as one: counts
    add up, ages are the oldest, a consumer's pending entries add up and its idle time is its
    least (it is as idle as its most recent read on any shard)."""
    if len(parts) == 1:
        return parts[0]

    def oldest(ages: list[float | None]) -> float | None:
        known = [a for a in ages if a is not None]
        return max(known) if known else None

    by_name: dict[str, ConsumerStats] = {}
    for c in (c for p in parts for c in p.consumers):
        seen = by_name.get(c.name)
        by_name[c.name] = (
            c
            if seen is None
            else ConsumerStats(c.name, seen.pending + c.pending, min(seen.idle_s, c.idle_s))
        )
    return GroupStats(
        any(p.exists for p in parts),
        sum(p.length for p in parts),
        sum(p.lag for p in parts),
        sum(p.pending for p in parts),
        oldest([p.oldest_pending_age_s for p in parts]),
        oldest([p.oldest_unread_age_s for p in parts]),
        tuple(by_name.values()),
    )
