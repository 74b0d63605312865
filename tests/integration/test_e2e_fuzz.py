"""Issue 12: 20,000 fuzz entries into each of the three streams a stranger can reach (a model's
requests, a worker's inbox, a coordinator's results) while canary requests run, with the
coordinator and the worker as real processes. Every canary gets its terminal event, every fuzz
request with a readable id is answered, and no process stops."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from e2e_helpers import local_tokens, wait_for, wait_ready

from kvq import client
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor import Monitor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
N_FUZZ = 20_000  # per stream
CANARY_TIMEOUT_S = 180.0


def _tensor(rng: random.Random, shape: list[int]) -> dict[str, Any]:
    arr = np.asarray([rng.random() for _ in range(int(np.prod(shape)))], np.float32)
    return {"dtype": "float32", "shape": shape, "data": arr.tobytes()}


def _valid(kind: str, rng: random.Random, i: int) -> dict[str, Any]:
    """A map that decodes (before mutation), for each stream's message type."""
    if kind == "request":
        return {"v": 2, "request_id": f"fuzz-{i}", "model": "tiny", "prompt": "x", "max_tokens": 1}
    if kind == "job":
        ids = {"dtype": "int64", "shape": [1, 2], "data": np.array([[0, 1]], "<i8").tobytes()}
        return {
            "v": 1,
            "job_id": f"c1:{rng.randrange(100)}",
            "model": "tiny",
            "layer": 0,
            "slice": "L000-001:E0000-0008",
            "expert_start": 0,
            "expert_end": 8,
            "coord": "c1",
            "reply_to": f"fuzz:out:{rng.randrange(4)}",
            "deadline_ms": 0,
            "x": _tensor(rng, [1, 64]),
            "ids": ids,
            "weights": _tensor(rng, [1, 2]),
        }
    return {
        "v": 1,
        "job_id": f"c1:{rng.randrange(1000)}",
        "worker": "w0",
        "compute_ms": 1.0,
        "y": _tensor(rng, [1, 64]),
    }


JUNK: list[Any] = [None, -1, 2**70, "", "\udcff", b"\xff\xfe", [], {}, [1, [2]], 1.5, True]


def _mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = dict(body)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice([*out, "surprise"])
        op = rng.random()
        if op < 0.3:
            out.pop(key, None)
        elif op < 0.9:
            out[key] = rng.choice(JUNK)
        else:
            out["v"] = rng.choice([0, 99, "1"])
    return out


def fuzz_entry(kind: str, rng: random.Random, i: int) -> dict[str, Any]:
    """One stream entry: garbage bytes, a missing field, a random msgpack value, or a message
    with 1-3 fields dropped, retyped or added (2% stay valid, so some fuzz is real work)."""
    roll = rng.random()
    if roll < 0.15:
        return {"m": rng.randbytes(rng.randrange(64))}
    if roll < 0.2:
        return {"x": b"no m"}
    body = _valid(kind, rng, i)
    value = rng.choice(JUNK) if roll < 0.3 else body if roll > 0.98 else _mutate(body, rng)
    try:
        return {"m": msgspec.msgpack.encode(value)}
    except (TypeError, UnicodeEncodeError, OverflowError):  # a value msgpack cannot hold
        return {"m": rng.randbytes(8)}


def _flood(r: Any, stream: str, kind: str, seed: int) -> None:
    rng = random.Random(seed)
    for start in range(0, N_FUZZ, 500):
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + 500):
            pipe.xadd(stream, fuzz_entry(kind, rng, i))
        pipe.execute()


def test_fuzz_into_every_stream_loses_no_canary(
    settings: Settings, tiny_model: Path, tmp_path: Path, run_in_thread
) -> None:
    s = settings.model_copy(
        update={
            "saturation_threshold": 1,
            "slice_experts": 8,
            "slice_layers": 1,
            "dispatch_policy": "copies",
            "job_deadline_ms": 2000,
            "heartbeat_ttl_s": 3.0,
        }
    )
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    run_in_thread(mon)
    r, keys = mon.board.r, Keys(s.prefix)
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path / "logs"))
    want = local_tokens(tiny_model, "canary", 4)
    outcomes: list[str] = []
    stop = threading.Event()

    def canaries() -> None:
        while not stop.is_set():
            try:
                rid, entry = client.submit(r, keys, "tiny", prompt="canary", max_tokens=4)
            except client.RequestFailed:  # the fuzz filled the queue: refused, not queued
                outcomes.append("refused")
                time.sleep(0.5)
                continue
            try:
                got = [
                    e.token_id
                    for e in client.events(r, keys, rid, CANARY_TIMEOUT_S, entry)
                    if e.token_id is not None
                ]
                outcomes.append("done" if got == want else f"wrong {got}")
            except client.RequestFailed as exc:
                outcomes.append(f"error {exc}")
            except TimeoutError:
                outcomes.append("lost")
            except Exception as exc:  # noqa: BLE001 - reported by the test, not the thread
                outcomes.append(f"failed {exc!r}")
                return

    try:
        kids.spawn("worker", "worker", "--id", "w0")
        wait_ready(mon, "tiny", 1)
        kids.spawn(
            "coordinator",
            "coordinator",
            "--model-id",
            "tiny",
            "--model",
            str(tiny_model),
            "--id",
            "c1",
        )
        kids.wait_for(lambda: r.exists(keys.coord_slots("c1")), 120, "the coordinator")
        loops = [threading.Thread(target=canaries, daemon=True) for _ in range(2)]
        for t in loops:
            t.start()
        streams = [
            (keys.model_requests("tiny"), "request"),
            (keys.worker_inbox("w0"), "job"),
            (keys.worker_results("w0", "c1"), "result"),
        ]
        t0 = time.monotonic()
        for seed, (stream, kind) in enumerate(streams):
            _flood(r, stream, kind, seed)
        flood_s = time.monotonic() - t0
        wait_for(lambda: r.xlen(keys.model_requests("tiny")) == 0, 400, "the fuzz consumed")
        drain_s = time.monotonic() - t0
        after = len(outcomes)  # canaries submitted after the flood complete too: two a loop
        wait_for(
            lambda: outcomes[after:].count("done") >= 2 * len(loops),
            CANARY_TIMEOUT_S,
            "canaries submitted after the drain to complete",
        )
        stop.set()
        for t in loops:
            t.join(CANARY_TIMEOUT_S + 10)
        assert not kids.dead(), f"no process stopped: {kids.dead()}"
        lost, done = outcomes.count("lost"), outcomes.count("done")
        bad = [o for o in outcomes if o not in ("done", "refused")]
        print(
            f"fuzz {3 * N_FUZZ} entries written in {flood_s:.1f}s, requests drained in "
            f"{drain_s:.1f}s; canaries {len(outcomes)}: done {done}, refused at submit "
            f"{outcomes.count('refused')}, lost {lost}; dead letters {r.xlen(keys.deadletter())}"
        )
        assert lost == 0, "every canary gets a terminal event"
        assert not bad, bad[:3]
        assert done >= 10
    finally:
        stop.set()
        kids.stop_all()
