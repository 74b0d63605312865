"""`kvq bench bus --cluster N`: aggregate job round trips with inboxes spread over N masters,
against the same run on one server, in one command.

N pairs of (driver, worker) processes; pair i has its own inbox and results stream under one
hash tag chosen to land on master i, so on the cluster each master carries one pair's traffic.
Each driver keeps a window of kvq jobs (4 KiB, `wire.Job`) in flight through its worker (kvq's
`Consumer`, decode, echo result, ack) for a fixed time. The figure is the sum of the pairs'
jobs/s; `ratio` is cluster ÷ single server.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from redis.crc import key_slot

from kvq import wire
from kvq.bus import Consumer, connect, ensure_group, xadd
from kvq.config import load_settings
from kvq.keys import Keys
from kvq.local.cluster import SLOTS, EmbeddedCluster
from kvq.local.server import EmbeddedRedis
from kvq.tools.bench.bus import BATCH, MAXLEN, WINDOW, _job


def pair_tags(n: int) -> list[str]:
    """One hash tag per master: tag i hashes into the i-th of n even slot ranges (the ranges
    `EmbeddedCluster` gives its masters)."""
    per, k = SLOTS // n, 0
    tags: list[str] = []
    while len(tags) < n:
        tag = f"b{k}"
        if min(key_slot(tag.encode()) // per, n - 1) == len(tags):
            tags.append(tag)
        k += 1
    return tags


def _streams(tag: str) -> tuple[str, str]:
    keys = Keys("kvq")
    return keys.bench_tagged(tag, "inbox"), keys.bench_tagged(tag, "results")


def _worker(url: str, tag: str, stop_at: float) -> None:
    r = connect(load_settings(redis_url=url).bus)
    inbox, results = _streams(tag)
    c = Consumer(r, inbox, "bench", "w")
    while time.monotonic() < stop_at:
        entries = c.read(BATCH, 100)
        appends = []
        for _eid, fields in entries:
            job = wire.decode(fields, wire.Job)
            res = wire.Result(job_id=job.job_id, worker="w", y=job.x)
            appends.append((results, wire.encode(res), None))
        if entries:
            c.answer(appends, [eid for eid, _ in entries], MAXLEN)


def _driver(url: str, tag: str, start_at: float, stop_at: float, out: Any) -> None:
    r = connect(load_settings(redis_url=url).bus)
    inbox, results = _streams(tag)
    keys = Keys("kvq")
    payload = wire.encode(_job(0, keys))
    last, in_flight, done = b"0-0", 0, 0
    while time.monotonic() < start_at:
        time.sleep(0.001)
    while time.monotonic() < stop_at:
        pipe = r.pipeline(transaction=False)
        for _ in range(WINDOW - in_flight):
            xadd(pipe, inbox, payload, MAXLEN)
        pipe.execute()
        in_flight = WINDOW
        resp = r.xread({results: last}, count=WINDOW, block=100)
        for _, batch in resp or []:
            for eid, fields in batch:
                wire.decode(fields, wire.Result)
                last = eid
                done += 1
                in_flight -= 1
    out.put(done)


def _run(url: str, tags: list[str], seconds: float) -> float:
    r = connect(load_settings(redis_url=url).bus)
    for tag in tags:
        for key in _streams(tag):
            r.delete(key)
        ensure_group(r, _streams(tag)[0], "bench")
    r.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 3.0  # every process up and connected first
    stop_at = start_at + seconds
    procs = [ctx.Process(target=_worker, args=(url, t, stop_at + 1)) for t in tags]
    procs += [ctx.Process(target=_driver, args=(url, t, start_at, stop_at, out)) for t in tags]
    for p in procs:
        p.start()
    total = sum(int(out.get(timeout=seconds + 60)) for _ in tags)
    for p in procs:
        p.join(10)
    return total / seconds


def run_cluster_bench(masters: int = 3, seconds: float = 5.0) -> dict[str, Any]:
    """Aggregate jobs/s of `masters` pairs on one server and on a `masters`-master cluster."""
    tags = pair_tags(masters)
    with EmbeddedRedis() as one:
        single = _run(one.url, tags, seconds)
    with EmbeddedCluster(masters) as cl:
        spread = _run(cl.url, tags, seconds)
        client = connect(load_settings(redis_url=cl.url).bus)
        ports = sorted({client.get_node_from_key(_streams(t)[0]).port for t in tags})
        client.close()
    return {
        "masters": masters,
        "pairs": len(tags),
        "seconds": seconds,
        "single_jobs_per_s": round(single, 1),
        "cluster_jobs_per_s": round(spread, 1),
        "ratio": round(spread / single, 3) if single else 0.0,
        "masters_used": len(ports),
    }
