"""Issue 10 item 3 on a real Redis and a real worker loop: while the worker computes one job
of a batch, its heartbeat reports that job's rows as busy and the rest as queued, per
coordinator; once the batch is done, nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from waiting import wait_for

from kvq import wire
from kvq.config import Settings
from kvq.gguf.meta import read_meta
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny
from kvq.worker import Worker
from kvq.worker.backlog import Backlog


def _job(model: Path, sid: str, job_id: str, coord: str, rows: int) -> dict[bytes, bytes]:
    meta = read_meta(model)
    x = np.ones((rows, meta.embedding_length), dtype=np.float32)
    ids = np.zeros((rows, 2), dtype=np.int32)
    ids[:, 1] = 1
    w = np.full(ids.shape, 0.5, dtype=np.float32)
    return wire.encode(
        wire.Job(
            job_id=job_id,
            model="m",
            layer=0,
            slice=sid,
            expert_start=0,
            expert_end=8,
            coord=coord,
            reply_to=f"{coord}-results",
            deadline_ms=0,
            x=wire.Tensor.of(x),
            ids=wire.Tensor.of(ids),
            weights=wire.Tensor.of(w),
        )
    )


def test_heartbeat_reports_the_batch_being_served(
    settings: Settings, tmp_path: Path, run_in_thread
) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(update={"slice_experts": 8, "base_replicas": 1})
    (sid,) = Monitor.from_settings(s).register("m", model).slices
    worker = Worker.from_settings(s, "w")
    run_in_thread(worker)
    wait_for(lambda: worker.server is not None and worker.holding is not None, 20)
    assert worker.server is not None
    gate, handle = threading.Event(), worker.server.handle

    def held(job: wire.Job) -> wire.Result:  # the first job blocks until the test looked
        gate.wait(20)
        return handle(job)

    worker.server.handle = held  # type: ignore[method-assign]
    worker.board.send_jobs(
        [
            ("w", _job(model, sid, "j1", "cA", 5)),
            ("w", _job(model, sid, "j2", "cB", 7)),
            ("w", _job(model, sid, "j3", "cA", 2)),
        ]
    )

    def beat() -> tuple[int, int, dict[str, int]] | None:
        info = worker.board.worker_info("w")
        return None if info is None else (info.busy_rows, info.queued_rows, info.queued_by_coord())

    # read together: 2 jobs queued by rows; read apart: j1 busy, 2 unread jobs counted at
    # the next beat (one row each until the worker has a mean rows per job)
    wait_for(lambda: beat() in ((5, 9, {"cA": 7, "cB": 7}), (5, 2, {"cA": 5})), 20)
    gate.set()
    wait_for(lambda: beat() == (0, 0, {}), 20)
    assert isinstance(worker.membership.backlog, Backlog)
    worker.stop.set()
