"""`kvq bench api`: the OpenAI gateway's cost. Time to first token and tokens/s of the same
greedy requests, `--streams` at a time, through `kvq api` (HTTP, server-sent events) and
straight through Redis (`kvq.client`), on one system: embedded Redis, a monitor, a
coordinator with `--streams` slots, optional workers and one `kvq api`, all processes.

Time to first token is to the first text a client can show (a token that ends inside a
character shows nothing yet), on both sides. The sides alternate (direct, api, direct, api, ...) after a warm-up, so that a drift of the
machine's load hits both; each side's figures are the best of its rounds.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq import client
from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis
from kvq.tools.synth import make_tiny

MODEL_ID = "bench"
COORD_ID = "bench-coord"


@dataclass(frozen=True, slots=True)
class ApiBenchOptions:
    streams: int = 8
    requests: int = 32  # per side and round
    max_tokens: int = 32
    rounds: int = 2
    model_path: str | None = None
    workers: int = 0


Call = Callable[[int], tuple[float, int]]  # request i -> (seconds to first token, tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _direct(settings: Settings, max_tokens: int) -> Call:
    r, keys = open_board(settings.bus, settings.lifetimes).r, Keys(settings.prefix)

    def call(i: int) -> tuple[float, int]:  # one client for all threads: it pools connections
        t0 = time.perf_counter()
        rid = client.send(r, keys, MODEL_ID, prompt=f"request {i} says", max_tokens=max_tokens)
        first, n = 0.0, 0
        for ev in client.events(r, keys, rid, timeout_s=120):
            n += ev.kind == "token"
            if first == 0.0 and ev.text:  # the first text, as the api side measures it
                first = time.perf_counter() - t0
        return first or time.perf_counter() - t0, n

    return call


def _api(port: int, max_tokens: int) -> Call:
    def call(i: int) -> tuple[float, int]:
        body = json.dumps(
            {
                "model": MODEL_ID,
                "prompt": f"request {i} says",
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"kvq api answered {resp.status}: {resp.read()[:300]!r}")
        first, n = 0.0, 0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = int(chunk["usage"]["completion_tokens"])
            elif first == 0.0 and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
        conn.close()
        return first or time.perf_counter() - t0, n

    return call


def _round(call: Call, streams: int, requests: int) -> dict[str, float]:
    """`requests` calls, `streams` at a time: TTFT percentiles and aggregate tokens/s."""
    todo = list(range(requests))
    lock = threading.Lock()
    out: list[tuple[float, int]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            try:
                got = call(i)
            except BaseException as exc:  # noqa: BLE001 - reported after the round
                errors.append(exc)
                return
            with lock:
                out.append(got)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    ttft = sorted(f for f, _ in out)
    tokens = sum(n for _, n in out)
    return {
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 2),
        "ttft_p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))] * 1000, 2),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }


def _best(rounds: list[dict[str, float]]) -> dict[str, float]:
    return max(rounds, key=lambda r: r["tokens_per_s"])


def run_api_bench(settings: Settings, opts: ApiBenchOptions) -> dict[str, Any]:
    """Run the bench; the `--json` document."""
    server = EmbeddedRedis().start()
    tmp = tempfile.TemporaryDirectory(prefix="kvq-bench-api-")
    children: Children | None = None
    try:
        model = opts.model_path or str(Path(tmp.name) / "tiny.gguf")
        if not opts.model_path:
            make_tiny(model, layers=2, experts=8, experts_used=2, tokenizer="bpe")
        port = _free_port()
        s = _bench_settings(settings, opts, server.url, port)
        env = child_env(s)
        env.setdefault("OMP_NUM_THREADS", "1")
        children = Children(env)
        _start_system(s, opts, children, model, port)
        direct, api = _direct(s, opts.max_tokens), _api(port, opts.max_tokens)
        _round(direct, opts.streams, opts.streams)  # warm-up: caches, connections, pools
        _round(api, opts.streams, opts.streams)
        d_rounds, a_rounds = [], []
        for _ in range(opts.rounds):
            d_rounds.append(_round(direct, opts.streams, opts.requests))
            a_rounds.append(_round(api, opts.streams, opts.requests))
        return _report(opts, d_rounds, a_rounds)
    finally:
        if children is not None:
            children.stop_all()
        server.close()
        tmp.cleanup()


def _bench_settings(settings: Settings, opts: ApiBenchOptions, url: str, port: int) -> Settings:
    """The settings every child runs with: the embedded Redis, one slot a stream, room to queue."""
    return settings.model_copy(
        update={
            "redis_url": url,
            "n_slots": opts.streams,
            "api_port": port,
            "api_max_queue": max(settings.api_max_queue, opts.requests + 1),
            "saturation_threshold": min(settings.saturation_threshold, opts.streams),
        }
    )


def _start_system(
    s: Settings, opts: ApiBenchOptions, children: Children, model: str, port: int
) -> None:
    """Monitor, coordinator, workers and the api, each waited for until it serves."""
    board = open_board(s.bus, s.lifetimes)
    children.spawn("monitor", "monitor", "--model", f"{MODEL_ID}={model}")
    _wait(lambda: MODEL_ID in board.models(), children, "model registration")
    children.spawn(
        "coordinator", "coordinator", "--model-id", MODEL_ID, "--model", model, "--id", COORD_ID
    )
    for i in range(opts.workers):
        children.spawn(f"worker-{i}", "worker", "--id", f"bench-worker-{i}")
    children.spawn("api", "api")
    _wait(lambda: board.coordinator_alive(COORD_ID), children, "the coordinator")
    _wait(lambda: _up(port), children, "kvq api")


def _report(
    opts: ApiBenchOptions, d_rounds: list[dict[str, float]], a_rounds: list[dict[str, float]]
) -> dict[str, Any]:
    """The `--json` document: the best round of each path and their ratios."""
    d, a = _best(d_rounds), _best(a_rounds)
    return {
        "streams": opts.streams,
        "requests": opts.requests,
        "max_tokens": opts.max_tokens,
        "rounds": opts.rounds,
        "workers": opts.workers,
        "direct": d,
        "api": a,
        "ratio": round(a["tokens_per_s"] / d["tokens_per_s"], 3),
        # each api round against the direct round just before it: robust to load drift
        "ratio_paired_median": round(
            statistics.median(
                x["tokens_per_s"] / y["tokens_per_s"]
                for x, y in zip(a_rounds, d_rounds, strict=True)
            ),
            3,
        ),
        "ttft_ratio": round(a["ttft_p50_ms"] / max(d["ttft_p50_ms"], 1e-3), 3),
        "direct_rounds": d_rounds,
        "api_rounds": a_rounds,
    }


def _up(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _wait(cond: Callable[[], bool], children: Children, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = children.dead()
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}")
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
