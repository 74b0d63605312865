"""A serving worker keeps answering while it asks the market for more (K9, K4): the ask's round
trips (the market, the reads it decides on) run beside the serving loop, not in it. Far from
Redis they cost several round trips each heartbeat; in the loop they held every job that
arrived meanwhile (measured at 20 ms RTT: about 110 ms added to one job in five)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from waiting import wait_for

from kvq import wire
from kvq.bus.market import Market
from kvq.config import Settings
from kvq.gguf import read_meta
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny
from kvq.worker import Worker
from kvq.worker.membership import Held


class _GatedMarket:
    """The worker's market, whose asks made while it holds a slice wait for `gate`."""

    def __init__(self, inner: Market, worker: Worker) -> None:
        self.inner, self.worker = inner, worker
        self.gate, self.waiting = threading.Event(), threading.Event()

    def volunteer(
        self,
        worker: str,
        held: Mapping[str, Collection[str]] | None = None,
        room: int | None = None,
        skip: Collection[str] = (),
    ) -> Held | None:
        if held:
            self.waiting.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.volunteer(worker, held, room, skip=skip)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _job(model: Path, sid: str, job_id: str) -> dict[bytes, bytes]:
    x = np.ones((2, read_meta(model).embedding_length), dtype=np.float32)
    ids = np.array([[0, 1], [2, 3]], dtype=np.int32)
    w = np.full(ids.shape, 0.5, dtype=np.float32)
    return wire.encode(
        wire.Job(
            job_id=job_id,
            model="m",
            layer=0,
            slice=sid,
            expert_start=0,
            expert_end=4,
            coord="c",
            reply_to="c-results",
            deadline_ms=0,
            x=wire.Tensor.of(x),
            ids=wire.Tensor.of(ids),
            weights=wire.Tensor.of(w),
        )
    )


def test_jobs_are_answered_while_an_ask_for_another_slice_waits_on_the_market(
    settings: Settings, tmp_path: Path, run_in_thread: Any
) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(update={"slice_experts": 4, "base_replicas": 1})
    info = Monitor.from_settings(s).register("m", model)
    assert len(info.slices) == 2
    worker = Worker.from_settings(s, "w")
    market = _GatedMarket(worker.membership.market, worker)
    worker.membership.market = market
    run_in_thread(worker)
    wait_for(lambda: worker.holding is not None, 20)
    held = worker.holding
    assert held is not None
    assert market.waiting.wait(20), "holding one slice, the worker asks for the other"
    results = worker.board.keys.worker_results("w", "c")
    for i in range(3):  # the ask is still waiting on the market all along
        worker.board.send_jobs([("w", _job(model, held.sid, f"j{i}"))])
        wait_for(lambda i=i: worker.board.r.xlen(results) == i + 1, 20)
        assert not market.gate.is_set()
    got = [wire.decode(f, wire.Result) for _, f in worker.board.r.xrange(results)]
    assert [r.job_id for r in got] == ["j0", "j1", "j2"]
    assert all(r.error is None and r.y is not None for r in got)
    market.gate.set()  # the ask goes on: the worker takes and serves the second slice too
    wait_for(lambda: len(worker.holdings) == 2, 20)
    assert {h.sid for h in worker.holdings} == set(info.slices)
