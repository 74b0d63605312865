"""`kvq bench elastic`: the elastic loop (K6-K12) timed through real processes.

An embedded Redis, a monitor, a coordinator and one idle worker (`base_replicas` 0: at rest
nothing is wanted of it) on a generated model cut into two slices; the slice source is the
local model file, so a recruited worker reads it from disk (the "already cached" case).
A closed loop of client threads (`kvq.tools.bench.closed_loop`) then drives three phases:

1. **saturated** (`saturated_s`): `sequences` clients. `saturation_to_first_remote_s` runs
   from the first slot state showing `busy >= threshold` to the first remote result (a K4
   trial's or a routed job's): the monitor's enter hold, its poll, the worker's volunteer
   poll, the slice load and warm-up, a routing refresh and one round trip.
   `remote_share_saturated` = remote results / expert jobs from then to the phase's end;
2. **noisy** (`noisy_s`): the number of clients jumps at random (seeded) every 0.5-3 s
   between `threshold - 1` and `threshold + 1`, so busy slots hover around the threshold.
   `boost_flips` counts changes of the monitor's `saturated` flag (what raises and drops the
   boost) seen by polling it every 0.2 s; `boost_flips_per_10min` scales that count to ten
   minutes (a shorter window, scaled: the JSON says which);
3. **drain**: no clients. `drain_to_release_s` runs from the last request's end to the worker
   giving its slice back (K10): it waits for the monitor to leave saturation
   (`saturation_leave_s`) and for `idle_release_s` without a job, both reported.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.bus.records import CoordStats
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, child_env, load_settings
from kvq.errors import ConfigError, KvqError
from kvq.gguf.meta import read_meta
from kvq.local.cluster import local_redis
from kvq.local.procs import Children
from kvq.tools.bench.closed_loop import ClosedLoop
from kvq.tools.synth import make_tiny

MODEL_ID = "elastic"
COORD_ID = "elastic-coord"
WORKER_ID = "elastic-worker"
TARGET_FIRST_REMOTE_S = 15.0
TARGET_FLIPS_PER_10MIN = 1.0
# 4 layers, 16 experts top-4, hidden 512, Q4_K (about 40 MB): quick to make and load
DEFAULT_MODEL = {
    "layers": 4,
    "experts": 16,
    "experts_used": 4,
    "hidden": 512,
    "expert_ffn": 512,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 64,
    "quant": "q4_k",
}


@dataclass(frozen=True)
class ElasticBench:
    model: str | None = None  # a GGUF file; None: DEFAULT_MODEL in a temp dir
    sequences: int = 4
    max_tokens: int = 16
    saturated_s: float = 30.0
    noisy_s: float = 45.0
    idle_release_s: float = 10.0  # KVQ_IDLE_RELEASE_S for the worker (default setting: 90)
    saturation_enter_s: float | None = None  # None: the setting's default
    saturation_leave_s: float | None = None
    monitor_poll_s: float | None = None
    dispatch_policy: str = "capacity"
    release_timeout_s: float = 300.0
    seed: int = 0
    log_dir: str | None = None
    cluster: int = 0  # > 0: on a local Redis Cluster of that many masters

    def check(self) -> None:
        if self.sequences < 3:
            raise ConfigError("--sequences >= 3 (the noisy phase steps around threshold 2)")
        if self.saturated_s <= 0 or self.noisy_s <= 0 or self.max_tokens < 1:
            raise ConfigError("--saturated-s > 0, --noisy-s > 0, --max-tokens >= 1")
        if self.dispatch_policy not in ("capacity", "copies"):
            raise ConfigError("--policy is capacity or copies")


def _settings(cfg: ElasticBench, url: str, model: str) -> Settings:
    meta = read_meta(model)
    extra: dict[str, Any] = {
        k: v
        for k, v in (
            ("saturation_enter_s", cfg.saturation_enter_s),
            ("saturation_leave_s", cfg.saturation_leave_s),
            ("monitor_poll_s", cfg.monitor_poll_s),
        )
        if v is not None
    }
    if "monitor_poll_s" in extra:
        extra["monitor_lease_s"] = max(3.0, 3 * extra["monitor_poll_s"])
    return load_settings(
        redis_url=url,
        prefix="kvqelastic",
        n_slots=cfg.sequences,
        saturation_threshold=2,
        slice_layers=meta.block_count,
        slice_experts=max(1, meta.expert_count // 2),
        base_replicas=0,
        boost_replicas=1,
        idle_release_s=cfg.idle_release_s,
        worker_max_slices=1,  # the worker takes one of the two slices, as the figures assume
        idle_shutdown_s=0,
        dispatch_policy=cfg.dispatch_policy,
        max_tokens_limit=max(512, cfg.max_tokens),
        **extra,
    )


def run_elastic_bench(cfg: ElasticBench) -> dict[str, Any]:
    cfg.check()
    with (
        tempfile.TemporaryDirectory(prefix="kvq-elastic-") as tmp,
        local_redis(cfg.cluster) as server,
    ):
        model = cfg.model or str(Path(tmp) / "model.gguf")
        if cfg.model is None:
            make_tiny(model, **DEFAULT_MODEL)  # type: ignore[arg-type]
        s = _settings(cfg, server.url, model)
        env = child_env(s) | {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        kids = Children(env, log_dir=cfg.log_dir or str(Path(tmp) / "logs"))
        board = open_board(s.bus, s.lifetimes)
        load = ClosedLoop(s.redis_url, s.prefix, MODEL_ID, cfg.sequences, cfg.max_tokens)
        try:
            _start(kids, board, model)
            out = _phases(cfg, s, board, kids, load)
        finally:
            load.set_active(0)
            load.stop(timeout_s=10)
            kids.stop_all()
    return {
        "model": cfg.model or f"generated {DEFAULT_MODEL}",
        "policy": cfg.dispatch_policy,
        "sequences": cfg.sequences,
        "max_tokens": cfg.max_tokens,
        "saturation_threshold": s.saturation_threshold,
        "monitor_poll_s": s.monitor_poll_s,
        "saturation_enter_s": s.saturation_enter_s,
        "saturation_leave_s": s.saturation_leave_s,
        "idle_release_s": s.idle_release_s,
        "targets": {
            "saturation_to_first_remote_s": TARGET_FIRST_REMOTE_S,
            "boost_flips_per_10min": TARGET_FLIPS_PER_10MIN,
        },
    } | out


def _start(kids: Children, board: RedisBoard, model: str) -> None:
    kids.spawn("monitor", "monitor", "--model", f"{MODEL_ID}={model}")
    kids.wait_for(lambda: MODEL_ID in board.models(), 600, "model registration")
    kids.spawn(
        "coordinator", "coordinator", "--model-id", MODEL_ID, "--model", model, "--id", COORD_ID
    )
    kids.spawn("worker", "worker", "--id", WORKER_ID)
    kids.wait_for(lambda: board.coordinator_alive(COORD_ID), 600, "the coordinator")
    kids.wait_for(lambda: board.worker_alive(WORKER_ID), 60, "the worker's idle heartbeat")


def _phases(
    cfg: ElasticBench, s: Settings, board: RedisBoard, kids: Children, load: ClosedLoop
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    load.set_active(cfg.sequences)
    t_sat = _until(kids, load, lambda: _busy(board) >= s.saturation_threshold, 60, "saturation")
    t_remote = _until(
        kids,
        load,
        lambda: _remote_results(board) > 0,
        max(cfg.saturated_s, 120.0),
        "the first remote result",
    )
    out["saturation_to_first_remote_s"] = round(t_remote - t_sat, 2)
    st0, tok0, w0 = _stats(board), load.tokens, time.monotonic()
    _sleep(kids, load, max(t0 + cfg.saturated_s, w0 + 2.0) - w0)
    st1, w1 = _stats(board), time.monotonic()
    jobs = sum(
        getattr(st1, f) - getattr(st0, f) for f in ("local_jobs", "remote_jobs", "fallback_jobs")
    )
    remote = st1.remote_jobs - st0.remote_jobs
    out |= {
        "remote_share_saturated": round(remote / jobs, 3) if jobs else 0.0,
        "saturated_window_s": round(w1 - w0, 1),
        "tok_s_saturated": round((load.tokens - tok0) / (w1 - w0), 2),
    }
    out |= _noisy(cfg, board, kids, load)
    load.set_active(0)
    t_idle = _until(kids, load, load.idle, 600, "the last requests to finish")
    t_rel = _until(
        kids,
        load,
        lambda: WORKER_ID not in board.assignments(MODEL_ID),
        cfg.release_timeout_s,
        "the worker to release its slice",
    )
    out["drain_to_release_s"] = round(t_rel - t_idle, 2)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _noisy(
    cfg: ElasticBench, board: RedisBoard, kids: Children, load: ClosedLoop
) -> dict[str, Any]:
    """Clients jump between threshold - 1 and + 1; the monitor's flag changes are counted."""
    rng = random.Random(cfg.seed)
    start = time.monotonic()
    end = start + cfg.noisy_s
    flag, flips, next_jump = _saturated(board), 0, start
    saturated_at_start = flag
    while (now := time.monotonic()) < end:
        if now >= next_jump:
            load.set_active(rng.choice((1, 2, 3)))  # threshold 2
            next_jump = now + rng.uniform(0.5, 3.0)
        _check(kids, load)
        got = _saturated(board)
        flips += got != flag
        flag = got
        time.sleep(0.2)
    window = time.monotonic() - start
    return {
        "boost_flips": flips,
        "noisy_window_s": round(window, 1),
        "boost_flips_per_10min": round(flips * 600 / window, 2),
        "noisy_scaled_from_s": round(window, 1),
        "noisy_started_saturated": saturated_at_start,
    }


def _check(kids: Children, load: ClosedLoop) -> None:
    if kids.dead():
        raise KvqError(f"{', '.join(kids.dead())} exited during the bench; see its log")
    if load.errors:
        raise KvqError(f"requests failed during the bench: {load.errors[0]}")


def _until(
    kids: Children, load: ClosedLoop, cond: Callable[[], object], timeout_s: float, what: str
) -> float:
    """The monotonic time at which `cond()` first held (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        _check(kids, load)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic()


def _sleep(kids: Children, load: ClosedLoop, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _check(kids, load)
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def _busy(board: RedisBoard) -> int:
    views = board.coordinators(MODEL_ID)
    return max((v.state.busy for v in views if v.state is not None), default=0)


def _stats(board: RedisBoard) -> CoordStats:
    return board.coord_stats(COORD_ID) or CoordStats()


def _remote_results(board: RedisBoard) -> int:
    st = _stats(board)
    return st.remote_jobs + st.trials_answered


def _saturated(board: RedisBoard) -> bool:
    state = board.model_state(MODEL_ID)
    return state is not None and state.saturated
