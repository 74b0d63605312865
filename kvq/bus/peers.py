"""A key a peer (a worker, under its own ACL user) wrote with the wrong type or size.

A worker may write anything into its own keys (`P:{w:W}:*`): another type in place of its
`info` hash, its inbox or its results stream, 10^5 fields or entries. Every role reads such a
key type-safely and boundedly (pipelines with `raise_on_error=False`, `HMGET` of known fields,
`COUNT` on every stream read) and, when the read fails, skips that worker: it is the worker's
fault, and no other role or worker pays for it. `blame` logs it, once per key per minute.
"""

from __future__ import annotations

import logging
import time

import redis

from kvq.bus.outage import refusal

log = logging.getLogger("kvq.bus")
_EVERY_S = 60.0
_blamed: dict[str, float] = {}  # key -> when it was last logged


def is_peer_fault(reply: object) -> bool:
    """Whether a pipeline reply is an error that a key's writer caused (`WRONGTYPE`, or any
    other error reply about one key), not the server's state: a refusal to write or a lost
    connection are waited out by the role's loop (`kvq.bus.outage`)."""
    return (
        isinstance(reply, redis.ResponseError)
        and refusal(reply) is None
        and not isinstance(reply, redis.exceptions.NoPermissionError)
    )


def blame(key: str, why: object, worker: str = "") -> None:
    """Log that `key` (of `worker`, when known) was skipped (`why`: the error or a
    description), at most once per key per minute (debug in between): a worker that keeps its
    key broken must not flood every reader's log."""
    now = time.monotonic()
    text = " ".join(str(why).split())[:200]
    if now - _blamed.get(key, -_EVERY_S) < _EVERY_S:
        log.debug("skipping %s: %s", key, text)
        return
    if len(_blamed) > 4096:
        _blamed.clear()
    _blamed[key] = now
    whose = f"worker {worker}" if worker else "its writer"
    log.warning(
        "skipping %s: %s (the fault of %s, who wrote that key; the other roles and workers go on)",
        key,
        text,
        whose,
    )
