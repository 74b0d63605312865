"""`kvq bench pool`: a model none of the workers can hold, served by all of them.

Real processes on this machine, as root: the embedded Redis, a monitor that registers the full
GGUF (the workers load their slices from it), a coordinator started on the backbone-only file
(`kvq model split`), so every expert job is remote, and `workers` workers. Each worker runs in
its own memory cgroup capped at `cap_fraction` x the model's routed-expert bytes (its
`KVQ_WORKER_MEMORY_GIB`) plus `overhead_mib` for the Python process itself, and, where
`ip netns` works, in its own network namespace, reaching Redis through a `DelayProxy` that
adds the run's round trip (`kvq.tools.bench.pool_sandbox`).

Per `--rtt-ms` value: fresh workers join, the bench waits until every slice is held by a live
worker and the copies settle, then a closed loop of each `--sequences` value runs `warmup_s`
and is measured for `measure_s` (tok/s, remote share, the coordinator's wait per MoE layer and
token, CPU seconds of the coordinator and of the workers, the bytes each worker holds). After
the last RTT's windows, with the largest `--sequences` running, the worker holding the most
slices gets SIGKILL: `recover_s` is the time until every slice is held again by live workers
other than it, `failed_requests` the requests that ended in an error during that phase.

CPUs (2 here): the coordinator is pinned to the first, the workers, Redis, the monitor and the
clients share the second; every process runs with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.bus.histogram import Histogram
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, child_env, load_settings
from kvq.errors import ConfigError
from kvq.local.cluster import local_redis
from kvq.local.procs import Children

from . import pool_report as report
from .pool_load import CountingLoad
from .pool_workers import PoolWorkers

MODEL_ID = "pool"
SURVIVORS_CANNOT = "the workers left after a kill cannot hold the model: (workers - 1) x cap < 1"
COORD_ID = "pool-coord"


@dataclass(frozen=True)
class PoolBench:
    preset: str = "small"
    model: str | None = None  # a GGUF file instead of the preset
    cache_dir: str = "~/.cache/kvq/pool"  # where the preset and its backbone are written
    workers: int = 3
    cap_fraction: float = 0.7
    overhead_mib: int = 1024
    rtts_ms: tuple[float, ...] = (0.0, 5.0, 20.0)
    sequences: tuple[int, ...] = (1, 8)
    max_tokens: int = 16
    warmup_s: float = 5.0
    measure_s: float = 20.0
    kill: bool = True
    netns: bool = True
    hb_ttl_s: float = 3.0  # KVQ_HEARTBEAT_TTL_S of every process
    copies: int = 2  # KVQ_BACKBONE_REPLICAS: copies per slice wanted (no saturation boost)
    recover_timeout_s: float = 60.0
    microbatches: int = 1
    log_dir: str | None = None
    grain: str = "expert"  # KVQ_GRAIN: "stage" cuts the model into layer spans (X12)
    stage_layers: int = 4  # KVQ_STAGE_LAYERS
    verify: str = "sampled"  # KVQ_VERIFY_REMOTE: "off" compares like for like with llama.cpp

    def check(self) -> None:
        if not 1 <= self.workers <= 16:
            raise ConfigError(f"--workers must be in 1..16, got {self.workers}")
        if not 0 < self.cap_fraction <= 4:
            raise ConfigError(f"--cap-fraction must be in (0, 4], got {self.cap_fraction}")
        if self.kill and self.workers < 2:
            raise ConfigError("the SIGKILL phase needs --workers >= 2 (or --no-kill)")
        if not self.rtts_ms or any(r < 0 for r in self.rtts_ms):
            raise ConfigError(f"--rtt-ms values must be >= 0, got {list(self.rtts_ms)}")
        if not self.sequences or any(not 1 <= n <= 64 for n in self.sequences):
            raise ConfigError(f"--sequences values must be in 1..64, got {list(self.sequences)}")
        if self.max_tokens < 1 or self.measure_s <= 0 or self.warmup_s < 0:
            raise ConfigError("--max-tokens >= 1, --measure-s > 0, --warmup-s >= 0")
        if not 1 <= self.microbatches <= 8 or self.overhead_mib < 0 or self.copies < 1:
            raise ConfigError("--microbatches in 1..8, --overhead-mib >= 0, --copies >= 1")
        if self.grain not in ("expert", "stage") or self.stage_layers < 1:
            raise ConfigError("--grain expert|stage, --stage-layers >= 1")
        if self.verify not in ("sampled", "all", "off"):
            raise ConfigError(f"--verify sampled|all|off, got {self.verify!r}")


def _survivors_hold(cfg: PoolBench) -> bool:
    return (cfg.workers - 1) * cfg.cap_fraction >= 1


def run_pool_bench(cfg: PoolBench) -> dict[str, Any]:
    """The report (`kvq.tools.bench.pool_report`), or {"skipped": line} without root or cgroups."""
    from .pool_sandbox import netns_works, skip_reason

    cfg.check()
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    if len(os.sched_getaffinity(0)) < 2:
        raise ConfigError("kvq bench pool needs 2 CPUs (coordinator and workers apart)")
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    os.sched_setaffinity(0, {cpus[1]})
    try:
        return _run(cfg, cpus[0], cpus[1], cfg.netns and netns_works())
    finally:
        os.sched_setaffinity(0, mine)


def model_files(cfg: PoolBench) -> tuple[Path, Path]:
    """(full GGUF, backbone GGUF), written to the cache once."""
    from kvq.gguf.split import write_backbone
    from kvq.tools.synth.presets import preset_named, write_preset

    if cfg.model:
        full = Path(cfg.model)
    else:
        full = Path(cfg.cache_dir).expanduser() / f"{cfg.preset}.gguf"
        if not full.is_file():
            full.parent.mkdir(parents=True, exist_ok=True)
            preset = preset_named(cfg.preset)
            write_preset(full.with_suffix(".part"), preset, preset.quant)
            full.with_suffix(".part").rename(full)
    backbone = full.with_name(full.stem + "-backbone.gguf")
    if not backbone.is_file() or backbone.stat().st_mtime < full.stat().st_mtime:
        write_backbone(full, backbone)
    return full, backbone


def _run(cfg: PoolBench, coord_cpu: int, side_cpu: int, netns: bool) -> dict[str, Any]:
    full, backbone = model_files(cfg)
    log_dir = cfg.log_dir or str(Path(cfg.cache_dir).expanduser() / "logs")
    with local_redis() as server:
        s = _pool_settings(cfg, server.url)
        env = child_env(s) | {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        kids = Children(env, log_dir=log_dir)
        board = open_board(s.bus, s.lifetimes)
        try:
            sizes, shape = _start_roles(kids, board, full, backbone, coord_cpu, side_cpu)
            expert_bytes = sum(sizes.values())
            budget = cfg.cap_fraction * expert_bytes
            pool = PoolWorkers(
                kids,
                board,
                s,
                MODEL_ID,
                sizes,
                side_cpu,
                netns,
                budget,
                int(budget) + cfg.overhead_mib * 2**20,
            )
            runs, kill = _rounds(board, s, cfg, kids, pool)
        finally:
            kids.stop_all()
    return report.build(
        cfg,
        full,
        backbone,
        expert_bytes,
        len(sizes),
        shape,
        netns,
        runs,
        kill,
        (coord_cpu, side_cpu),
    )


def _pool_settings(cfg: PoolBench, redis_url: str) -> Settings:
    """The settings every child runs with."""
    return load_settings(
        redis_url=redis_url,
        prefix="kvqpool",
        n_slots=max(cfg.sequences),
        saturation_threshold=min(2, max(cfg.sequences)),  # loaded at 1 sequence too
        max_tokens_limit=max(512, cfg.max_tokens),
        idle_shutdown_s=0,
        idle_release_s=0,
        heartbeat_ttl_s=cfg.hb_ttl_s,
        monitor_poll_s=0.5,
        microbatches=cfg.microbatches,
        backbone_replicas=cfg.copies,
        base_replicas=1,
        boost_replicas=0,
        grain=cfg.grain,
        stage_layers=cfg.stage_layers,
        verify_remote=cfg.verify,
    )


def _start_roles(
    kids: Children,
    board: RedisBoard,
    full: Path,
    backbone: Path,
    coord_cpu: int,
    side_cpu: int,
) -> tuple[dict[str, int], dict[str, int]]:
    """The monitor and the coordinator, each waited for: the slices' sizes and the model's
    shape."""
    kids.spawn("monitor", "monitor", "--model", f"{MODEL_ID}={full}", cpus={side_cpu})
    kids.wait_for(lambda: MODEL_ID in board.models(), 600, "model registration")
    info = board.model_info(MODEL_ID)
    assert info is not None
    sizes = {sid: sl.nbytes for sid, sl in info.slices.items()}
    shape = report.shape_of(info.meta, len(sizes))
    kids.spawn(
        "coordinator",
        "coordinator",
        "--model-id",
        MODEL_ID,
        "--model",
        str(backbone),
        "--id",
        COORD_ID,
        cpus={coord_cpu},
    )
    kids.wait_for(lambda: board.coordinator_alive(COORD_ID), 600, "the coordinator")
    return sizes, shape


def _rounds(
    board: RedisBoard, s: Settings, cfg: PoolBench, kids: Children, pool: PoolWorkers
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each RTT: the pool started, one window per sequence count; the kill phase after the
    last: the runs and the kill phase's figures."""
    runs: list[dict[str, Any]] = []
    kill = None
    for i, rtt in enumerate(cfg.rtts_ms):
        try:
            joined = pool.start(cfg.workers, rtt)
            for n in cfg.sequences:
                runs.append(
                    {"rtt_ms": rtt, "sequences": n, "join": joined}
                    | _window(board, s, cfg, kids, pool, n)
                )
            last = i == len(cfg.rtts_ms) - 1
            if cfg.kill and last:
                kill = (
                    _kill_phase(board, s, cfg, kids, pool)
                    if _survivors_hold(cfg)
                    else {"skipped": SURVIVORS_CANNOT}
                )
        finally:
            pool.stop()
    return runs, kill


def _window(
    board: RedisBoard, s: Settings, cfg: PoolBench, kids: Children, pool: PoolWorkers, n: int
) -> dict[str, Any]:
    """One closed loop of `n` sequences: warm-up, then the measured window's figures."""
    load = CountingLoad(s, MODEL_ID, n, cfg.max_tokens)
    try:
        time.sleep(cfg.warmup_s)
        t0, st0, cpu0 = time.monotonic(), board.coord_stats(COORD_ID), pool.cpu_s()
        kids.wait_for(
            lambda: time.monotonic() >= t0 + cfg.measure_s,
            cfg.measure_s + 5,
            "the measured window",
            poll_s=0.2,
        )
        t1, st1, cpu1 = time.monotonic(), board.coord_stats(COORD_ID), pool.cpu_s()
        tokens = load.tokens_between(t0, t1)
        held = pool.holdings()
    finally:
        load.stop()
    out = report.window(st0, st1, t1 - t0, tokens, cpu0, cpu1, pool.layers)
    return out | {
        "failed_requests": load.failed,
        "completed_requests": load.ok,
        "errors": load.errors[:3],
        "workers": held,
    }


def _kill_phase(
    board: RedisBoard, s: Settings, cfg: PoolBench, kids: Children, pool: PoolWorkers
) -> dict[str, Any]:
    """SIGKILL of the worker holding the most slices under the largest load; re-cover time."""
    n = max(cfg.sequences)
    load = CountingLoad(s, MODEL_ID, n, cfg.max_tokens)
    try:
        time.sleep(max(3.0, cfg.warmup_s))
        before = pool.copies()
        victim, lost, alone = pool.kill_busiest()
        killed = time.monotonic()
        recover_s: float | None = None
        while time.monotonic() - killed < cfg.recover_timeout_s:
            if pool.covered(without=victim):
                recover_s = time.monotonic() - killed
                break
            kids.wait_for(lambda: True, 1, "")  # a child that died ends the bench here
            time.sleep(0.1)
        time.sleep(10.0)  # serve on with the survivors
        end = time.monotonic()
        uncovered = pool.uncovered(without=victim)
    finally:
        load.stop(timeout_s=cfg.recover_timeout_s)
    hist = Histogram.from_text(st.job_rtt_s) if (st := board.coord_stats(COORD_ID)) else None
    return {
        "rtt_ms": pool.rtt_ms,
        "sequences": n,
        "victim": victim,
        "victim_slices": lost,
        "victim_only_copies": alone,
        "uncovered_after": uncovered,
        "copies_before": before,
        "copies_after": pool.copies(),
        "recover_s": None if recover_s is None else round(recover_s, 2),
        "recover_timeout_s": cfg.recover_timeout_s,
        "heartbeat_ttl_s": cfg.hb_ttl_s,
        "failed_requests": load.failed + load.stuck,
        "stuck_requests": load.stuck,
        "completed_requests": load.ok,
        "errors": load.errors[:3],
        "longest_token_gap_s": round(load.longest_gap_s(killed, end), 2),
        "tok_s_after_kill": round(load.tokens_between(killed, end) / (end - killed), 3),
        "job_rtt_mean_ms": round(1000 * hist.sum / hist.count, 2) if hist and hist.count else None,
    }
