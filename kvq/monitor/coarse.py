"""Coarse background jobs on RQ: model registration, histogram collection, hot-set planning.

These take seconds to minutes (registration reads and checksums every slice of a GGUF file)
and must not stall the monitor's loop, which reaps workers and sets demand. They go on the RQ
queue `<KVQ_PREFIX>:coarse` (`kvq:coarse`), so they show in `rq info`; each monitor runs one RQ worker for it on a
thread (`CoarseJobs.serve`). The token path never goes through RQ.

RQ is not Redis-Cluster-safe (its keys share no hash tag), so it has its own URL,
`KVQ_RQ_URL` (empty: `KVQ_REDIS_URL`), which must be a standalone server: a cluster node is
refused at start. Jobs and their results travel as JSON (RQ's `JSONSerializer`): no pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from kvq.bus.board import Board
from kvq.errors import ConfigError, KvqError

log = logging.getLogger("kvq.monitor")


def queue_name(prefix: str) -> str:
    """The RQ queue of one kvq prefix (RQ's own keys: `rq:queue:<name>`, `rq:job:<id>`)."""
    return f"{prefix}:coarse"


JOB_TIMEOUT_S = 3600  # a registration checksums the whole file: minutes for tens of GB


@dataclass(frozen=True, slots=True)
class _Context:
    board: Board


_context: _Context | None = None  # set by `CoarseJobs.serve` in the process running the jobs


def _board() -> Board:
    if _context is None:
        raise KvqError("this coarse job needs a monitor's RQ worker (kvq monitor) to run it")
    return _context.board


# -- the jobs (module-level: RQ finds them by import path; arguments and results are JSON) ---
def register_model(
    model: str,
    path: str,
    source: str | None,
    slice_layers: int,
    slice_experts: int,
    base_replicas: int,
    request_shards: int = 1,
    grain: str = "expert",
    stage_layers: int = 4,
) -> dict[str, Any]:
    """Plan `model`'s slices (checksumming each) and publish it on the board."""
    from kvq.gguf.registry import plan_model
    from kvq.monitor.registration import publish

    info = plan_model(
        model, path, slice_layers, slice_experts, source, request_shards, grain, stage_layers
    )
    publish(_board(), info, base_replicas)
    return {"model": model, "slices": len(info.slices)}


def collect_histogram(
    model_path: str, prompts: list[str], tokens: int, out: str, device: str
) -> dict[str, Any]:
    """`kvq balance collect`: routing counts of greedy generation, saved as HIST.json."""
    from kvq.bank.collect import collect_histogram as collect
    from kvq.bank.hist import save_hist

    hist = collect(model_path, prompts, tokens, device)
    save_hist(hist, out)
    routed = sum(int(t.counts.sum()) for t in hist.layers)
    return {"out": out, "layers": len(hist.layers), "routed": routed}


def plan_hot_set(hist_path: str, budget_bytes: int) -> dict[str, Any]:
    """`kvq balance plan`: the hot set for a byte budget, as JSON."""
    from kvq.bank.hist import load_hist
    from kvq.bank.hot_set import plan_hot_set as plan

    doc: dict[str, Any] = plan(load_hist(hist_path).layers, budget_bytes).to_json()
    return doc


def _wake() -> None:
    """Sent to one worker's own queue to make it look at its stop flag."""


class ThreadWorker(SimpleWorker):  # type: ignore[misc]  # rq is untyped here
    """An RQ worker on a thread of its process: no signal handlers (the process's main
    thread owns them) and job timeouts by timer, not SIGALRM."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass


class CoarseJobs:
    """The coarse-job queue on `url`; `serve()` also runs this process's worker for it."""

    def __init__(self, url: str, prefix: str, name: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.name = name
        _refuse_cluster(self.r)
        self.queue = Queue(
            queue_name(prefix),
            connection=self.r,
            serializer=JSONSerializer,
            default_timeout=JOB_TIMEOUT_S,
        )
        # one worker's own queue: `close()` wakes its blocking dequeue through it
        self._own = Queue(f"{self.queue.name}:{name}", connection=self.r, serializer=JSONSerializer)
        self._worker: ThreadWorker | None = None
        self._thread: threading.Thread | None = None

    def serve(self, board: Board) -> None:
        """Run jobs from the queue on a thread until `close()`."""
        global _context
        _context = _Context(board)
        self._worker = ThreadWorker(
            [self.queue, self._own], connection=self.r, serializer=JSONSerializer, name=self.name
        )
        self._thread = threading.Thread(target=self._work, name="rq-coarse", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        assert self._worker is not None
        try:
            self._worker.work(logging_level="WARNING")
        except Exception:  # the monitor goes on without its coarse worker
            log.exception("the RQ coarse-job worker stopped")

    def close(self, timeout_s: float = 5.0) -> None:
        if self._worker is not None and self._thread is not None:
            self._worker._stop_requested = True
            try:
                self._own.enqueue(_wake)
            except redis.RedisError as exc:  # Redis down: the worker's thread dies with us
                log.warning("could not wake the RQ coarse-job worker to stop it: %s", exc)
            else:
                self._thread.join(timeout_s)
        self.r.close()

    def enqueue(self, func: Any, *args: Any) -> Job:
        return self.queue.enqueue(func, *args, job_timeout=JOB_TIMEOUT_S)

    def wait(self, job: Job, timeout_s: float) -> Any:
        """The job's result; KvqError if it failed, TimeoutError if not done in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = job.get_status(refresh=True)
            if status == JobStatus.FINISHED:
                return job.return_value()
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                res = job.latest_result()
                why = ((res.exc_string if res else "") or "").strip().splitlines()
                raise KvqError(f"coarse job {job.func_name} failed: {why[-1] if why else status}")
            time.sleep(0.05)
        raise TimeoutError(
            f"coarse job {job.id} not done in {timeout_s}s: is a kvq monitor running?"
        )


def _refuse_cluster(r: redis.Redis) -> None:
    try:
        enabled = r.info("cluster").get("cluster_enabled")
    except redis.ResponseError:  # a server without the section is no cluster node
        return
    except redis.ConnectionError:  # not up yet: the monitor waits for it like any client
        log.warning("could not check that KVQ_RQ_URL is standalone: its server is unreachable")
        return
    if enabled:
        raise ConfigError(
            "KVQ_RQ_URL points at a Redis Cluster node; RQ is not cluster-safe: give it a "
            "standalone Redis (KVQ_RQ_URL=redis://host:port/0)"
        )
