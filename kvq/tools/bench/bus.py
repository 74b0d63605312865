"""`kvq bench bus`: round trips of 4 KiB expert jobs, kvq vs raw redis-py vs RQ, in one run.

Three ways to do the same thing, measured on the same server in the same run:
- `kvq`: wire.Job → XADD inbox → Consumer (XREADGROUP) → decode → result XADD + XACK → decode;
- `raw`: the same XADD / XREADGROUP / XADD+XACK pattern with opaque bytes and no codec;
- `rq`: an RQ job carrying the same payload, run by an `rq.SimpleWorker`.
The worker side of each runs in its own process. `one at a time` gives p50/p99 round trip;
`batched` keeps a window of jobs in flight and gives jobs/s.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from kvq import wire
from kvq.bus import Consumer, redacted_url, xadd
from kvq.config import Settings
from kvq.keys import Keys
from kvq.local.server import EmbeddedRedis
from kvq.slices import slice_id

ROWS, HIDDEN, TOPK = 8, 128, 2  # x is 8 x 128 float32 = 4 KiB
WINDOW, BATCH = 256, 64
ROUNDS = 5
MAXLEN = 100_000


def _job(i: int, keys: Keys) -> wire.Job:
    rng = np.random.default_rng(i)
    return wire.Job(
        job_id=f"bench-{i}",
        model="bench",
        layer=0,
        slice=slice_id(0, 1, 0, 4),
        expert_start=0,
        expert_end=4,
        coord="bench",
        reply_to=keys.bench("kvq-results"),
        deadline_ms=0,
        x=wire.Tensor.of(rng.standard_normal((ROWS, HIDDEN), dtype=np.float32)),
        ids=wire.Tensor.of(np.zeros((ROWS, TOPK), dtype=np.int32)),
        weights=wire.Tensor.of(np.full((ROWS, TOPK), 0.5, dtype=np.float32)),
    )


# -- worker sides (each in its own process) ------------------------------------------------
def _kvq_worker(url: str, inbox: str, results: str, n: int) -> None:
    r = redis.Redis.from_url(url)
    c = Consumer(r, inbox, "bench", "w")
    done = 0
    while done < n:
        entries = c.read(BATCH, 1000)
        pipe = r.pipeline(transaction=False)
        for _eid, fields in entries:
            job = wire.decode(fields, wire.Job)
            res = wire.Result(job_id=job.job_id, worker="w", y=job.x)  # echo, as raw does
            xadd(pipe, results, wire.encode(res), MAXLEN)
        if entries:
            pipe.xack(inbox, "bench", *[eid for eid, _ in entries])
            pipe.execute()
        done += len(entries)


def _raw_worker(url: str, inbox: str, results: str, n: int) -> None:
    r = redis.Redis.from_url(url)
    try:
        r.xgroup_create(inbox, "bench", id="0", mkstream=True)
    except redis.ResponseError:
        pass
    done = 0
    while done < n:
        resp = r.xreadgroup("bench", "w", {inbox: ">"}, count=BATCH, block=1000)
        entries = resp[0][1] if resp else []
        pipe = r.pipeline(transaction=False)
        for _eid, fields in entries:
            pipe.xadd(results, {"m": fields[b"m"]}, maxlen=MAXLEN, approximate=True)
        if entries:
            pipe.xack(inbox, "bench", *[eid for eid, _ in entries])
            pipe.execute()
        done += len(entries)


def echo(payload: bytes) -> bytes:
    """The RQ job: return the payload (the bus cost only, like the others)."""
    return payload


def _rq_worker(url: str, queue: str, n: int) -> None:
    from rq import Queue, SimpleWorker

    r = redis.Redis.from_url(url)
    w = SimpleWorker([Queue(queue, connection=r)], connection=r)
    w.work(with_scheduler=False, logging_level="WARNING")  # killed by the producer when done


# -- producer sides -----------------------------------------------------------------------
def _measure_stream(
    r: redis.Redis,
    inbox: str,
    results: str,
    n_single: int,
    n_batched: int,
    send: Callable[[Any, int], None],
    recv: Callable[[dict[bytes, bytes]], None],
) -> dict[str, float]:
    last = b"0-0"

    def read(count: int) -> int:
        nonlocal last
        resp = r.xread({results: last}, count=count, block=5000)
        got = 0
        for _, entries in resp or []:
            for eid, fields in entries:
                recv(fields)
                last = eid
                got += 1
        return got

    rtts = []
    for i in range(n_single):
        t0 = time.perf_counter()
        send(r, i)
        while read(1) == 0:
            pass
        rtts.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    sent = got = 0
    while got < n_batched:
        if sent < n_batched and sent - got < WINDOW:
            pipe = r.pipeline(transaction=False)
            k = min(BATCH, n_batched - sent)
            for j in range(k):
                send(pipe, n_single + sent + j)
            pipe.execute()
            sent += k
        got += read(WINDOW)
    wall = time.perf_counter() - t0
    return _figures(rtts, n_batched / wall)


def _figures(rtts: list[float], jobs_per_s: float) -> dict[str, float]:
    q = statistics.quantiles(rtts, n=100)
    return {
        "jobs_per_s": round(jobs_per_s, 1),
        "p50_ms": round(q[49], 4),
        "p99_ms": round(q[98], 4),
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-figure median over rounds."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _bench_kvq(url: str, keys: Keys, n_single: int, n_batched: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    inbox, results = keys.bench("kvq-inbox"), keys.bench("kvq-results")
    r.delete(inbox, results)
    proto = [_job(i, keys) for i in range(64)]  # building tensors is not the bus; encoding is timed

    def send(pipe: Any, i: int) -> None:
        xadd(pipe, inbox, wire.encode(proto[i % 64]), MAXLEN)

    def recv(fields: dict[bytes, bytes]) -> None:
        wire.decode(fields, wire.Result).y.array()  # type: ignore[union-attr]

    Consumer(r, inbox, "bench", "w")
    return _run_with_worker(
        _kvq_worker,
        (url, inbox, results, n_single + n_batched),
        lambda: _measure_stream(r, inbox, results, n_single, n_batched, send, recv),
    )


def _bench_raw(url: str, keys: Keys, n_single: int, n_batched: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    inbox, results = keys.bench("raw-inbox"), keys.bench("raw-results")
    r.delete(inbox, results)
    payloads = [wire.pack(_job(i, keys)) for i in range(64)]

    def send(pipe: Any, i: int) -> None:
        pipe.xadd(inbox, {"m": payloads[i % 64]}, maxlen=MAXLEN, approximate=True)

    def recv(fields: dict[bytes, bytes]) -> None:
        fields[b"m"]

    try:
        r.xgroup_create(inbox, "bench", id="0", mkstream=True)
    except redis.ResponseError:
        pass
    return _run_with_worker(
        _raw_worker,
        (url, inbox, results, n_single + n_batched),
        lambda: _measure_stream(r, inbox, results, n_single, n_batched, send, recv),
    )


def _bench_rq(url: str, keys: Keys, n_single: int, n_batched: int) -> dict[str, float]:
    from rq import Queue

    r = redis.Redis.from_url(url)
    q = Queue(keys.bench("rq"), connection=r)
    payload = wire.pack(_job(0, keys))

    def measure() -> dict[str, float]:
        rtts = []
        for _ in range(n_single):
            t0 = time.perf_counter()
            job = q.enqueue(echo, payload)
            job.latest_result(timeout=30)
            rtts.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        jobs = q.enqueue_many([Queue.prepare_data(echo, (payload,)) for _ in range(n_batched)])
        for job in jobs:
            job.latest_result(timeout=60)
        return _figures(rtts, n_batched / (time.perf_counter() - t0))

    return _run_with_worker(_rq_worker, (url, keys.bench("rq"), n_single + n_batched), measure)


def _run_with_worker(
    target: Callable[..., None], args: tuple[Any, ...], measure: Callable[[], dict[str, float]]
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        return measure()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_bus_bench(
    settings: Settings, jobs: int = 2000, redis_url: str | None = None
) -> dict[str, Any]:
    """Run all three; ratios compare figures measured in this same run."""
    server = None if redis_url else EmbeddedRedis().start()
    url = redis_url or (server.url if server else "")
    keys = Keys(settings.prefix)
    try:
        n_single = max(100, jobs // 10)
        # alternate kvq and raw rounds so that warm-up and machine noise hit both alike
        rounds: dict[str, list[dict[str, float]]] = {"kvq": [], "raw": []}
        for _ in range(ROUNDS):
            rounds["kvq"].append(_bench_kvq(url, keys, n_single, jobs))
            rounds["raw"].append(_bench_raw(url, keys, n_single, jobs))
        kvq, raw = _median(rounds["kvq"]), _median(rounds["raw"])
        rq_fig = _bench_rq(url, keys, max(50, n_single // 4), max(200, jobs // 10))
    finally:
        if server is not None:
            server.close()
    return {
        "payload_bytes": ROWS * HIDDEN * 4,
        "jobs": jobs,
        "rounds": ROUNDS,
        "kvq": kvq,
        "raw": raw,
        "rq": rq_fig,
        # paired: each kvq round against the raw round run right after it, then the median,
        # so that slow drifts of a shared machine cancel out
        "ratio_vs_raw_batched": round(
            statistics.median(
                k["jobs_per_s"] / r["jobs_per_s"]
                for k, r in zip(rounds["kvq"], rounds["raw"], strict=True)
            ),
            3,
        ),
        "ratio_rounds": [
            round(k["jobs_per_s"] / r["jobs_per_s"], 3)
            for k, r in zip(rounds["kvq"], rounds["raw"], strict=True)
        ],
        "ratio_vs_raw_p50": round(raw["p50_ms"] / kvq["p50_ms"], 3),
        "ratio_vs_rq": round(kvq["jobs_per_s"] / rq_fig["jobs_per_s"], 1),
        "redis": "embedded" if server else redacted_url(url),
    }
