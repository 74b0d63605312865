"""A worker answers each batch it reads in one round trip (issue 33: a lone worker with a
layer's jobs waits one RTT for them, not one per job), on a real Redis and a real worker loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_backlog import _job
from waiting import wait_for

from kvq import wire
from kvq.bus import Consumer
from kvq.config import Settings
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny
from kvq.worker import Worker


def test_a_batch_of_jobs_is_answered_in_one_round_trip(
    settings: Settings, tmp_path: Path, run_in_thread: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(update={"slice_experts": 8, "base_replicas": 1})
    (sid,) = Monitor.from_settings(s).register("m", model).slices
    batches: list[list[str]] = []
    answer_each = Consumer.answer_and_read

    def counted(self: Consumer, appends: Any, entry_ids: Any, *args: Any) -> Any:
        batches.append([str(stream) for stream, _, _ in appends])
        return answer_each(self, appends, entry_ids, *args)

    monkeypatch.setattr(Consumer, "answer_and_read", counted)
    worker = Worker.from_settings(s, "w")
    run_in_thread(worker)
    wait_for(lambda: worker.server is not None and worker.holding is not None, 20)
    assert worker.server is not None
    entered, gate, handle = threading.Event(), threading.Event(), worker.server.handle

    def held(job: wire.Job) -> wire.Result:  # the first job waits until the rest are queued
        if job.job_id == "j1":
            entered.set()
            gate.wait(20)
        return handle(job)

    worker.server.handle = held  # type: ignore[method-assign]
    worker.board.send_jobs([("w", _job(model, sid, "j1", "cA", 3))])
    assert entered.wait(20)
    worker.board.send_jobs(
        [("w", _job(model, sid, f"j{i}", c, 2)) for i, c in ((2, "cA"), (3, "cB"), (4, "cA"))]
    )
    gate.set()
    keys = worker.board.keys
    wait_for(lambda: sum(len(b) for b in batches) == 4, 20)
    assert [len(b) for b in batches] == [1, 3]  # j1 alone, then j2-j4 read and answered together
    a, b = keys.worker_results("w", "cA"), keys.worker_results("w", "cB")
    assert batches[1] == [a, b, a]
    got = {wire.decode(f, wire.Result).job_id for k in (a, b) for _, f in worker.board.r.xrange(k)}
    assert got == {"j1", "j2", "j3", "j4"}
    worker.stop.set()
