"""Inbox and results memory is bounded by the work in flight, not by MAXLEN (issue 12 item 6):
10,000 jobs of about 8 KB go through an inbox (consumer group, answered = acked and deleted)
and their results through a coordinator's results stream (read by a `Tail`, which deletes what
it read). The bytes each stream holds afterwards are stated and checked against what the same
entries cost when kept."""

from __future__ import annotations

import redis

from kvq.bus import Consumer, Tail, ensure_group, xadd
from kvq.config import Settings

JOBS = 10_000
PAYLOAD = b"x" * 8192  # an 8-row, hidden-256 float32 job is about this size
KEPT_BOUND = 64 * 1024  # an empty stream with its group and a few deleted-entry nodes


def test_ten_thousand_answered_jobs_leave_the_streams_small(settings: Settings) -> None:
    r = redis.Redis.from_url(settings.redis_url)
    inbox, results = f"{settings.prefix}:inbox", f"{settings.prefix}:results"
    try:
        ensure_group(r, inbox, "workers")
        worker = Consumer(r, inbox, "workers", "w")
        tail = Tail(r, results)
        sent = 0
        while sent < JOBS:
            pipe = r.pipeline(transaction=False)
            for _ in range(100):
                xadd(pipe, inbox, {b"job": PAYLOAD}, 100_000)
            pipe.execute()
            sent += 100
            entries = worker.read(count=100, block_ms=100)
            worker.answer(
                [(results, {b"y": PAYLOAD}, None)] * len(entries),
                [eid for eid, _ in entries],
                100_000,
            )
            assert len(tail.read(count=1000, block_ms=None)) == len(entries)
        tail.read(count=1000, block_ms=None)  # deletes the last batch it read
        inbox_bytes = int(r.memory_usage(inbox) or 0)
        results_bytes = int(r.memory_usage(results) or 0)
        assert r.xlen(inbox) == 0 and r.xlen(results) == 0
        kept = f"{settings.prefix}:kept"
        pipe = r.pipeline(transaction=False)
        for _ in range(1000):
            xadd(pipe, kept, {b"job": PAYLOAD}, 100_000)
        pipe.execute()
        kept_bytes = int(r.memory_usage(kept) or 0) * JOBS // 1000
        print(
            f"after {JOBS} jobs: inbox {inbox_bytes} B, results {results_bytes} B; "
            f"kept until MAXLEN they would be about {kept_bytes // 2**20} MiB each"
        )
        assert inbox_bytes < KEPT_BOUND and results_bytes < KEPT_BOUND
        assert kept_bytes > 1000 * KEPT_BOUND, "the bound means something"
    finally:
        r.close()
