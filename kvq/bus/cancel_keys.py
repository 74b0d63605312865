"""A request's own cancel key, `P:{r:R}:cancel` (`Keys.request_cancel`): set by its client,
read by its coordinator. The certain half of a cancel; the model's cancel stream is the hint
(`kvq.coordinator.cancels`). Here because the bus owns every TTL and existence rule."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from kvq.keys import Keys

TTL_S = 3600  # outlives any wait in the queue and any run


def mark(r: redis.Redis, keys: Keys, request_id: str) -> None:
    """Say that request `request_id` is given up on (for `TTL_S`)."""
    r.set(keys.request_cancel(request_id), b"1", ex=TTL_S)


def marked(r: redis.Redis, keys: Keys, request_ids: Iterable[str]) -> set[str]:
    """Those of `request_ids` whose cancel key is set (one pipelined round trip)."""
    rids = list(request_ids)
    if not rids:
        return set()
    pipe = r.pipeline(transaction=False)
    for rid in rids:
        pipe.exists(keys.request_cancel(rid))
    return {rid for rid, n in zip(rids, pipe.execute(), strict=True) if n}
