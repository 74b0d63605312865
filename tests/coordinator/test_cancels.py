"""Cancels survive a storm: 8 clients' cancels among 50,000 junk ones all reach a coordinator
(before: the stream was trimmed at about 1,000 and read 1,024 at a time, and none did)."""

from __future__ import annotations

import redis

from kvq import client, wire
from kvq.bus import cancel_keys
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


def test_a_cancel_survives_a_client_that_empties_the_stream(r: redis.Redis, prefix: str) -> None:
    """A client may `XADD ... MAXLEN 0` to the model's cancel stream (its ACL user may add
    entries, and Redis cannot forbid an argument): every hint is gone before a coordinator
    reads it. The requests' own cancel keys are not: 8 of 8 still reach the coordinator, and
    a request nobody cancelled is not taken for one."""
    keys = Keys(prefix)
    feed = CancelFeed(r, keys.model_cancels("m"), keys)
    real = [f"real-{i}" for i in range(8)]
    for rid in real:
        client.cancel(r, keys, "m", rid)
        r.xadd(keys.model_cancels("m"), {"junk": "1"}, maxlen=0, approximate=False)
    assert feed.poll() == set(), "the hints are gone"
    assert feed.check([*real, "never-cancelled"]) == set(real)
    assert 0 < r.ttl(keys.request_cancel(real[0])) <= cancel_keys.TTL_S
    assert feed.due(real) == set(real) and feed.due(real) == set(), "at most every 0.2 s"
