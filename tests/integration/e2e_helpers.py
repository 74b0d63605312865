"""Helpers for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from waiting import wait_for

from kvq.config import Settings
from kvq.keys import Keys
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.monitor import Monitor
from kvq.text import load_tokenizer
from kvq.worker import Worker


def wait_ready(mon: Monitor, model_id: str, n: int, timeout_s: float = 60.0) -> None:
    """Until `n` workers of `model_id` have loaded their slice and beat "serving"."""
    wait_for(
        lambda: sum(v.alive and v.ready for v in mon.board.workers(model_id)) == n,
        timeout_s,
        f"{n} workers loaded and serving",
    )


def local_tokens(model: Path, prompt: str, n: int) -> list[int]:
    """Greedy tokens of all-local generation: what every remote path must reproduce."""
    bb = Backbone.from_gguf(model)
    return generate(bb, load_tokenizer(model).encode(prompt), n)


def start_with_worker(
    s: Settings, model_id: str, model: Path, run_in_thread: Callable[[Any], Any]
) -> tuple[Monitor, Keys, Worker]:
    """Register `model` and run one worker (in a thread) until it has loaded its slice."""
    mon = Monitor.from_settings(s)
    mon.register(model_id, model)
    w = Worker.from_settings(s, "w0")
    run_in_thread(w)
    wait_for(lambda: w.holding is not None, what="a worker to volunteer")
    return mon, Keys(s.prefix), w


def ids_on_every_shard(n: int, shards: int, stem: str = "req") -> list[str]:
    """`n` request ids (n ≥ shards) that land on every one of `shards` request streams."""
    from kvq.keys import request_shard

    out: list[str] = []
    want = [i % shards for i in range(n)]
    i = 0
    while len(out) < n:
        rid = f"{stem}-{i}"
        if request_shard(rid, shards) == want[len(out)]:
            out.append(rid)
        i += 1
    return out
