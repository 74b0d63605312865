"""Streams with consumer groups: bounded appends, pending-first reads, dead letters."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from kvq.bus.peers import blame
from kvq.keys import Keys

Entry = tuple[bytes, dict[bytes, bytes]]
DEAD_FIELDS_BYTES = 1 << 20  # of an entry's values copied into one dead letter
_DEAD_FIELDS = 64  # of its fields copied
log = logging.getLogger("kvq.bus")


def is_lost_key(exc: BaseException) -> bool:
    """Whether `exc` is Redis saying a stream or its consumer group is gone (a restart without
    persistence, `FLUSHALL`, a `DEL`): `NOGROUP` from the group commands, `no such key` from
    `XINFO`. The caller makes them again (`ensure_group`) instead of failing."""
    text = str(exc)
    return isinstance(exc, redis.ResponseError) and (
        "NOGROUP" in text or "no such key" in text.lower()
    )


def is_wrong_type(exc: BaseException) -> bool:
    """Whether `exc` is Redis saying a key holds another type than the command needs."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def regroup(r: redis.Redis, stream: str, group: str, exc: redis.ResponseError) -> None:
    """Make `stream` and `group` again after Redis lost them (`is_lost_key`), logging it in one
    line. A key of another type in the stream's place (its writer's doing: a worker's inbox is
    its own key) holds nothing for this group: it is replaced by an empty stream. Any other
    error is raised."""
    if is_wrong_type(exc):
        log.warning("%s is not a stream (%s); replaced it with an empty one", stream, exc)
        r.delete(stream)
        ensure_group(r, stream, group)
        return
    if not is_lost_key(exc):
        raise exc
    log.warning("redis lost stream %s or its group %s; made them again", stream, group)
    ensure_group(r, stream, group)


def is_cluster(r: Any) -> bool:
    """Whether `r` is a Redis Cluster client (pipelines there are split per node)."""
    from redis.cluster import RedisCluster

    return isinstance(r, RedisCluster)


def xadd(
    r: redis.Redis | redis.client.Pipeline,
    stream: str,
    fields: Mapping[Any, Any],
    maxlen: int | None,
) -> Any:
    """XADD with approximate MAXLEN trimming, so no stream grows without bound; `maxlen` None
    for a stream whose unread entries must never be trimmed (requests: the writer checks the
    length first and refuses instead)."""
    return r.xadd(stream, dict(fields), maxlen=maxlen, approximate=maxlen is not None)


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
    stream: str | None = None,
) -> None:
    """Park an entry that cannot be processed, with the reason, on the dead-letter stream (or
    `stream`: a restricted worker's own, `Keys.worker_dead`): its first fields, up to
    `DEAD_FIELDS_BYTES` of values (a larger value is replaced by its size)."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    out: dict[str, Any] = {"source": source, "entry_id": eid, "reason": reason[:2000]}
    room = DEAD_FIELDS_BYTES  # the monitor deletes larger entries (kvq.monitor.quota)
    for k, v in list(fields.items())[:_DEAD_FIELDS]:
        name = k.decode(errors="replace")[:200] if isinstance(k, bytes) else str(k)[:200]
        size = len(v) if isinstance(v, bytes | str) else len(str(v))
        out[f"f.{name}"] = v if size <= room else f"({size} bytes, not kept: over {room})"
        room -= size if size <= room else 0
    out["ts_ms"] = int(time.time() * 1000)
    xadd(r, stream or keys.deadletter(), out, maxlen)


class Consumer:
    """One consumer in a group: re-reads its own pending entries first, then new ones.

    Call `read()` in a loop and `ack()` each entry once its effect (a result) is written.
    A consumer that restarts under the same name thus finishes what it had taken. The pending
    pass walks forward with a cursor, so each pending entry is returned once per pass even if
    the caller keeps some of them un-acked for a while (a coordinator's live requests).
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, name: str) -> None:
        self.r, self.stream, self.group, self.name = r, stream, group, name
        self._cluster = is_cluster(r)  # asked once: `answer` is on the hot path
        self._cursor: bytes | None = b"0"  # None: the pending pass is over
        self._ready: list[Entry] = []  # read with the last answers (`answer_and_read`)
        ensure_group(r, stream, group)

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries; `block_ms=None` returns at once when there are none."""
        if self._ready:
            got, self._ready = self._ready, []
            return got
        return self.read_pending(count) or self._read(">", count, block_ms)[0]

    def read_pending(self, count: int) -> list[Entry]:
        """Up to `count` of this consumer's own pending entries, each once per pass; [] once
        the pass is over (until `reset_pending`)."""
        while self._cursor is not None:
            got, last = self._read(self._cursor, count, None)
            self._cursor = last
            if got:
                return got
        return []

    def _read(
        self, start: bytes | str, count: int, block_ms: int | None
    ) -> tuple[list[Entry], bytes | None]:
        """(entries with fields, id of the last entry Redis returned or None if none)."""
        try:
            resp = self.r.xreadgroup(
                self.group, self.name, {self.stream: start}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            regroup(self.r, self.stream, self.group, exc)
            self._cursor = b"0"
            return [], None
        return self._entries(resp)

    def _entries(self, resp: Any) -> tuple[list[Entry], bytes | None]:
        """An XREADGROUP reply as (entries with fields, id of the last entry or None)."""
        if not resp or not resp[0][1]:
            return [], None
        _, entries = resp[0]
        # a pending entry trimmed from the stream comes back without fields: drop it
        gone = [eid for eid, flds in entries if not flds]
        if gone:
            self.ack(*gone)
        return [(eid, flds) for eid, flds in entries if flds], entries[-1][0]

    def ack(self, *entry_ids: bytes) -> None:
        """Acknowledge and delete the entries: an answered entry is never needed again, and
        kept it would hold memory until the stream's MAXLEN."""
        if entry_ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            pipe.execute()

    def answer(
        self,
        appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
        entry_ids: Sequence[bytes],
        maxlen: int,
    ) -> None:
        """Append each `(stream, fields, ttl_s)` (an answer: a result, reply events), then ack
        and delete `entry_ids`, in one round trip and in that order: an entry is never acked
        before its answer is written, so a crash in between re-delivers it instead of losing
        it. The first refused append raises, after every command has run."""
        _raise_first(self.answer_each(appends, entry_ids, maxlen))

    def answer_each(
        self,
        appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
        entry_ids: Sequence[bytes],
        maxlen: int,
    ) -> list[redis.RedisError | None]:
        """`answer` for a batch, in the same one round trip, with each append's refusal in
        its place (`answers_then_ack`)."""
        acks = {self.stream: list(entry_ids)} if entry_ids else {}
        return answers_then_ack(self.r, self._cluster, self.group, appends, acks, maxlen)

    def answer_and_read(
        self,
        appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
        entry_ids: Sequence[bytes],
        maxlen: int,
        count: int,
        block_ms: int | None,
    ) -> list[redis.RedisError | None]:
        """`answer_each`, and the next `read(count, block_ms)` in the same round trip: the
        answers, the acks, then a blocking XREADGROUP, pipelined, so that a consumer far from
        Redis is listening again as soon as its answers land, not one more round trip later.
        The entries wait for the next `read()`. Where the read cannot ride along (its pending
        pass is not over, a cluster splits pipelines per node) it is left to that `read()`."""
        if self._cluster or self._cursor is not None or self._ready:
            return self.answer_each(appends, entry_ids, maxlen)
        acks = {self.stream: list(entry_ids)} if entry_ids else {}
        pipe = self.r.pipeline(transaction=False)
        _queue_answers(pipe, self.group, appends, acks, maxlen)
        pipe.xreadgroup(self.group, self.name, {self.stream: ">"}, count=count, block=block_ms)
        *got, resp = pipe.execute(raise_on_error=False)
        errors = _answer_errors(got, appends, acks)
        if isinstance(resp, redis.ResponseError):  # the group or the stream went: as `_read`
            regroup(self.r, self.stream, self.group, resp)
            self._cursor = b"0"
        elif isinstance(resp, Exception):
            raise resp
        else:
            self._ready = self._entries(resp)[0]
        return errors

    def reset_pending(self) -> None:
        """Re-read own pending entries at the next `read()` (after a reconnect or a claim)."""
        self._cursor = b"0"
        self._ready = []  # pending too: the pass returns them


def answer_then_ack(
    r: redis.Redis,
    cluster: bool,
    group: str,
    appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
    acks: Mapping[str, Sequence[bytes]],
    maxlen: int,
) -> None:
    """Append each `(stream, fields, ttl_s)`, then ack and delete the entries `acks` names per
    stream, in that order (`Consumer.answer`): one round trip on one server; on a cluster a
    pipeline runs per node in no order between nodes, so the answers (other hash tags) are
    written first and the acks take a second round trip. The first refused append raises,
    after every command has run (as a pipeline does)."""
    _raise_first(answers_then_ack(r, cluster, group, appends, acks, maxlen))


def _raise_first(errors: Sequence[redis.RedisError | None]) -> None:
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def answers_then_ack(
    r: redis.Redis,
    cluster: bool,
    group: str,
    appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
    acks: Mapping[str, Sequence[bytes]],
    maxlen: int,
) -> list[redis.RedisError | None]:
    """`answer_then_ack`, with each append's own refusal (WRONGTYPE, NOPERM) returned in its
    place instead of raised: one bad answer does not hide whether the others were written.
    A lost connection still raises, and so does a refused ack."""
    pipe = r.pipeline(transaction=False)
    if acks and cluster:
        _queue_answers(pipe, group, appends, {}, maxlen)
        errors = _answer_errors(pipe.execute(raise_on_error=False), appends, {})
        pipe = r.pipeline(transaction=False)
        _queue_answers(pipe, group, (), acks, maxlen)
        _answer_errors(pipe.execute(raise_on_error=False), (), acks)
        return errors
    _queue_answers(pipe, group, appends, acks, maxlen)
    return _answer_errors(pipe.execute(raise_on_error=False), appends, acks)


def _queue_answers(
    pipe: Any,
    group: str,
    appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
    acks: Mapping[str, Sequence[bytes]],
    maxlen: int,
) -> None:
    """Queue each append (XADD, and EXPIRE where it has a TTL), then each stream's XACK and
    XDEL."""
    for stream, fields, ttl_s in appends:
        xadd(pipe, stream, fields, maxlen)
        if ttl_s is not None:
            pipe.expire(stream, ttl_s)
    for stream, ids in acks.items():
        pipe.xack(stream, group, *ids)
        pipe.xdel(stream, *ids)  # answered: see `Consumer.ack`


def _answer_errors(
    got: Sequence[Any],
    appends: Sequence[tuple[str, Mapping[Any, Any], int | None]],
    acks: Mapping[str, Sequence[bytes]],
) -> list[redis.RedisError | None]:
    """Per append, its refusal or None, from the replies of `_queue_answers`' commands; a
    refused ack, or any error that is no Redis reply, raises."""
    for reply in got[len(got) - 2 * len(acks) :] if acks else ():
        if isinstance(reply, Exception):
            raise reply
    errors: list[redis.RedisError | None] = []
    i = 0  # the first reply of the next append: its XADD, then its EXPIRE if it has a TTL
    for _, _, ttl_s in appends:
        n = 1 if ttl_s is None else 2
        bad = next((x for x in got[i : i + n] if isinstance(x, Exception)), None)
        if bad is not None and not isinstance(bad, redis.RedisError):
            raise bad
        errors.append(bad)
        i += n
    return errors


def claim_from_dead(
    r: redis.Redis,
    stream: str,
    group: str,
    me: str,
    alive: Callable[[str], bool],
    min_idle_ms: int,
) -> int:
    """Move pending entries of dead consumers (per `alive`) idle >= min_idle_ms to `me`.

    Only dead consumers are robbed: a live coordinator may legitimately hold a request for a
    long time while it generates. Returns how many entries were claimed. A stream or group
    that Redis lost (at any step) is made again: nothing was left to claim.
    """
    try:
        return _claim(r, stream, group, me, alive, min_idle_ms)
    except redis.ResponseError as exc:
        regroup(r, stream, group, exc)
        return 0


def _claim(
    r: redis.Redis,
    stream: str,
    group: str,
    me: str,
    alive: Callable[[str], bool],
    min_idle_ms: int,
) -> int:
    claimed = 0
    for info in r.xinfo_consumers(stream, group):
        name = info["name"].decode() if isinstance(info["name"], bytes) else str(info["name"])
        if name == me or not info["pending"] or alive(name):
            continue
        left = False
        while True:  # pages of 1000: claim what is idle enough, keep the consumer if any is not
            pend = r.xpending_range(stream, group, "-", "+", 1000, consumername=name)
            ids = [p["message_id"] for p in pend if p["time_since_delivered"] >= min_idle_ms]
            if ids:
                claimed += len(r.xclaim(stream, group, me, min_idle_ms, ids, justid=True))
            if len(ids) < len(pend):
                left = True
                break
            if len(pend) < 1000:
                break
        if not left:
            r.xgroup_delconsumer(stream, group, name)
    return claimed


def unanswered(r: redis.Redis, stream: str, limit: int = 10_000) -> list[Entry]:
    """Entries of a one-group stream never delivered, plus those delivered but not acked,
    among its first `limit` ([] for a stream Redis lost meanwhile, or a key of another type:
    a worker's inbox is its own key, and what it wrote there is no job of anyone's)."""
    try:
        groups = r.xinfo_groups(stream) if r.exists(stream) else []
        if not groups:
            return list(r.xrange(stream, count=limit))
        g = groups[0]
        last = g["last-delivered-id"]
        pending = {
            p["message_id"]
            for p in r.xpending_range(stream, g["name"], min="-", max="+", count=limit)
        }
        entries = r.xrange(stream, count=limit)
    except redis.ResponseError as exc:
        if not (is_lost_key(exc) or is_wrong_type(exc)):
            raise
        return []
    return [(eid, f) for eid, f in entries if eid in pending or _id_gt(eid, last)]


def never_delivered(r: redis.Redis, stream: str, group: str, limit: int) -> list[Entry]:
    """The first `limit` entries of `stream` no consumer of `group` has read yet (all of them
    before the group exists; [] for a missing key or one of another type)."""
    try:
        groups = r.xinfo_groups(stream) if r.exists(stream) else []
        mine = [g for g in groups if g["name"] in (group, group.encode())]
        last = mine[0]["last-delivered-id"] if mine else None
        entries = r.xrange(stream, min=last or "-", count=limit + 1)
    except redis.ResponseError as exc:
        if not (is_lost_key(exc) or is_wrong_type(exc)):
            raise
        return []
    return [(eid, f) for eid, f in entries if last is None or _id_gt(eid, last)][:limit]


def entry_ms(eid: bytes | str) -> int:
    """When Redis added stream entry `eid` (its id's ms part, the server's clock); 0 for an
    id that is not one."""
    text = eid.decode() if isinstance(eid, bytes) else eid
    ms = text.partition("-")[0]
    return int(ms) if ms.isdigit() else 0


def _id_gt(a: bytes, b: bytes) -> bool:
    ams, aseq = (int(p) for p in a.split(b"-"))
    bms, bseq = (int(p) for p in b.split(b"-"))
    return (ams, aseq) > (bms, bseq)


class Tail:
    """Reads streams from where it left off, without a group: a coordinator's results, one
    stream per worker (`Keys.worker_results`), so where an entry arrived says who wrote it."""

    def __init__(self, r: redis.Redis, *streams: str) -> None:
        self.r = r
        self._cluster = is_cluster(r)  # asked once: every results read checks it
        self.cursors: dict[str, bytes] = dict.fromkeys(streams, b"0-0")
        self._read: dict[str, list[bytes]] = {}  # ids returned by the last read, deleted next

    @property
    def stream(self) -> str:
        """The first stream read (a one-stream tail's only one)."""
        return next(iter(self.cursors))

    def watch(self, stream: str) -> bool:
        """Read `stream` too, from its start; True if it was not read yet."""
        if stream in self.cursors:
            return False
        self.cursors[stream] = b"0-0"
        return True

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries of every stream (`block_ms` None: do not block)."""
        return [(eid, f) for _, eid, f in self.read_from(count, block_ms)]

    def read_from(
        self, count: int, block_ms: int | None
    ) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        """New `(stream, id, fields)` entries. This reader is each stream's only one, so what
        it has read is deleted, in the same round trip as the next read (no extra round trip
        per batch)."""
        if not self.cursors:
            return []
        if self._cluster:
            return self._poll(count, block_ms)
        pipe = self.r.pipeline(transaction=False)
        self._queue_deletes(pipe)
        pipe.xread(dict(self.cursors), count=count, block=block_ms)
        resp = pipe.execute(raise_on_error=False)[-1]
        if isinstance(resp, redis.ResponseError) and self._drop_bad():
            return self.read_from(count, None)  # without the bad streams: at once
        if isinstance(resp, Exception):
            raise resp
        return self._take(resp)

    def _queue_deletes(self, pipe: Any) -> None:
        """Delete what the last read returned (an XDEL on a stream its writer made another
        type fails alone: the pipeline is read with `raise_on_error=False`)."""
        for stream, ids in self._read.items():
            pipe.xdel(stream, *ids)

    def _drop_bad(self) -> list[str]:
        """Stop reading the streams that are not streams (one such key fails the whole XREAD:
        each stream has one writer, whose fault it is); the streams dropped. `watch` may add
        one again (after its owner deletes it)."""
        pipe = self.r.pipeline(transaction=False)
        streams = list(self.cursors)
        for stream in streams:
            pipe.type(stream)
        bad = [
            s for s, t in zip(streams, pipe.execute(), strict=True) if t not in (b"stream", b"none")
        ]
        for stream in bad:
            self._drop(stream)
        return bad

    def _drop(self, stream: str) -> None:
        del self.cursors[stream]
        self._read.pop(stream, None)
        blame(stream, "it is no stream: stopped reading it")

    def _poll(
        self, count: int, block_ms: int | None
    ) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        """On a cluster: the streams have their own hash tags, so no one XREAD may name
        several, and one cannot block on several nodes: one XREAD per stream, pipelined,
        polled every millisecond until `block_ms`. A stream that is no stream is dropped."""
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            pipe = self.r.pipeline(transaction=False)
            self._queue_deletes(pipe)
            streams = list(self.cursors)
            for stream in streams:
                pipe.xread({stream: self.cursors[stream]}, count=count)
            resp = pipe.execute(raise_on_error=False)[-len(streams) :] if streams else []
            good: list[Any] = []
            for stream, got in zip(streams, resp, strict=True):
                if is_wrong_type(got):
                    self._drop(stream)
                elif isinstance(got, Exception):
                    raise got
                else:
                    good.extend(got or [])
            out = self._take(good)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.001)

    def _take(self, resp: Any) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
        out: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        self._read = {}
        for name, batch in resp or []:
            stream = name.decode() if isinstance(name, bytes) else str(name)
            if batch:
                self._read[stream] = [eid for eid, _ in batch]
                self.cursors[stream] = batch[-1][0]
                out.extend((stream, eid, f) for eid, f in batch)
        return out
