"""Cancels survive a storm: 8 clients' cancels among 50,000 junk ones all reach a coordinator
(before: the stream was trimmed at about 1,000 and read 1,024 at a time, and none did)."""

from __future__ import annotations

import redis

from kvq import client, wire
from kvq.bus.streams import xadd
from kvq.coordinator.cancels import CancelFeed
from kvq.keys import Keys

JUNK = 50_000


def _storm(r: redis.Redis, stream: str, n: int, stem: str) -> None:
    """`n` junk cancels, each written as `kvq.client.cancel` writes one (same cap)."""
    for start in range(0, n, 5_000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 5_000)):
            junk = wire.encode(wire.Cancel(request_id=f"{stem}{i}"))
            xadd(pipe, stream, junk, client.CANCEL_MAXLEN)
        pipe.execute()


def test_eight_cancels_among_50000_junk_are_all_read(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    feed = CancelFeed(r, keys.model_cancels("m"))
    real = [f"real-{i}" for i in range(8)]
    got: set[str] = set()
    for i, rid in enumerate(real):
        _storm(r, keys.model_cancels("m"), JUNK // 8, f"junk-{i}-")
        client.cancel(r, keys, "m", rid)
        if i % 3 == 0:
            got |= feed.poll()  # a coordinator polls meanwhile, as at its ticks
    got |= feed.poll()
    assert set(real) <= got, sorted(set(real) - got)
    assert all(feed.cancelled(rid) for rid in real[-4:])
    assert feed.poll() == set()
