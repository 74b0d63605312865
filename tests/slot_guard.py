"""Issue 14 item 2's pipeline guard, for the cluster run (`CLUSTER_TESTS=1`).

A single command that crosses slots fails by itself on a cluster (CROSSSLOT). A pipeline does
not: redis-py's cluster client splits it per node and runs the parts in no order between
nodes, so a pipeline whose keys sit in several slots silently loses its order. That is fine
when the order does not matter (reads, independent writes) and a bug when it does (an answer,
then the ack of what it answers).

So every pipeline executed on a cluster client is checked: the slots of its keys, and the
kvq function that built it. One whose keys span several slots must come from a function
listed in `ORDER_FREE`, each entry with why its order does not matter. A new multi-slot
pipeline fails the test that ran it until it is classified here (or made one-slot).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.cluster import ClusterPipeline
from redis.crc import key_slot

# "module:function" of the kvq code that builds a pipeline → why its parts may run in any order
ORDER_FREE: dict[str, str] = {
    "kvq.bus.streams:answers_then_ack": "on a cluster, answers go first and the acks in a "
    "second execute (two round trips): each execute's parts are independent",
    "kvq.bus.shards:_read_new": "one non-blocking XREADGROUP per shard, each on its own stream",
    "kvq.bus.streams:_poll": "one XREAD per results stream plus XDELs of entries already read",
    "kvq.api.gate:_queued": "XLEN of each request shard: reads",
    "kvq.bus.redis_board:request_shards": "SISMEMBER and HGET: reads",
    "kvq.bus.redis_board:coordinators": "HGETALL of each coordinator's slots: reads",
    "kvq.bus.redis_board:workers": "EXISTS and HGETALL of each worker's keys: reads",
    "kvq.bus.redis_board:send_jobs": "XADDs to several workers' inboxes: independent appends",
    "kvq.bus.cancel_keys:marked": "EXISTS of each request's cancel key: reads",
    "kvq.coordinator.results:watch": "DEL of results streams about to be read (redis-py "
    "splits a multi-key DEL per slot): independent deletes",
}

_KEYLESS = {"PING", "TIME", "INFO", "MULTI", "EXEC", "WATCH", "UNWATCH", "SCRIPT"}


def command_keys(args: tuple[Any, ...]) -> list[bytes]:
    """The keys of one command of kvq's (the stream reads name theirs after STREAMS)."""
    name = _b(args[0]).decode().upper()
    if name in _KEYLESS or len(args) < 2:
        return []
    if name in ("XREAD", "XREADGROUP"):
        flat = [_b(a).upper() for a in args]
        rest = list(args[flat.index(b"STREAMS") + 1 :])
        return [_b(k) for k in rest[: len(rest) // 2]]
    if name in ("EVALSHA", "EVAL", "FCALL"):
        n = int(args[2])
        return [_b(k) for k in args[3 : 3 + n]]
    return [_b(args[1])]


def _b(k: Any) -> bytes:
    return k if isinstance(k, bytes) else str(k).encode()


def _builder() -> str:
    """The innermost kvq frame (outside this guard) that is executing the pipeline."""
    frame = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("kvq."):
            return f"{mod}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<test code>"


@contextmanager
def guard_pipelines() -> Iterator[list[str]]:
    """While active, every multi-slot pipeline built by kvq outside `ORDER_FREE` is recorded
    (as "builder: slots, commands"); the caller fails the test if any was."""
    offences: list[str] = []
    original = ClusterPipeline.execute

    def execute(self: ClusterPipeline, raise_on_error: bool = True) -> Any:
        stack = getattr(self._execution_strategy, "_command_queue", [])
        slots = {key_slot(k) for c in stack for k in command_keys(tuple(c.args))}
        if len(slots) > 1:
            who = _builder()
            if who.startswith("kvq.") and who not in ORDER_FREE:
                names = sorted({str(c.args[0]) for c in stack})
                offences.append(f"{who}: {len(slots)} slots, commands {names}")
        return original(self, raise_on_error)

    ClusterPipeline.execute = execute  # type: ignore[method-assign]
    try:
        yield offences
    finally:
        ClusterPipeline.execute = original  # type: ignore[method-assign]
