"""`kvq bench microbatch`: engine steps with 1 and with n micro-batches, paired step by step.

`kvq bench offload --microbatches 1,2` compares whole runs, tens of seconds apart; on a shared
machine their tok/s can differ 2-3x for reasons that have nothing to do with kvq. This bench
pairs instead: one real coordinator (built in this process, pinned to the first CPU, one
thread), a real worker process holding half of every layer's experts (pinned to the second,
with Redis), reached directly or through a `DelayProxy` adding `rtt_ms`, and one engine whose
steps alternate between one micro-batch and `microbatches`, under load (busy = all slots, the
capacity split as configured). Alternate steps see the same machine within a few hundred ms,
so the ratio of their times is what micro-batching changes.

Every step runs through `Engine.step` with `Dispatcher.for_step(..., microbatches=arm)`: the
usual rule that only a step after a remote one is cut is bypassed, so both arms get every
step. Finished sequences are replaced at once; steps that prefill a new sequence are
reported apart (`decode_*`: steps of decode tokens only).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvq.config import child_env, load_settings
from kvq.coordinator import Coordinator
from kvq.errors import ConfigError
from kvq.gguf.meta import read_meta
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis
from kvq.monitor import Monitor
from kvq.tools.bench.delay_proxy import DelayProxy
from kvq.tools.bench.offload import DEFAULT_MODEL, _host_port
from kvq.tools.synth import make_tiny

MODEL_ID = "mb"


@dataclass(frozen=True)
class MicrobatchBench:
    model: str | None = None  # None: kvq.tools.bench.offload.DEFAULT_MODEL (about 240 MB)
    rtt_ms: float = 0.0
    microbatches: int = 2
    sequences: int = 8
    max_tokens: int = 48
    warmup_steps: int = 30
    pairs: int = 60
    dispatch_policy: str = "capacity"  # KVQ_DISPATCH_POLICY; copies: every layer goes remote
    log_dir: str | None = None

    def check(self) -> None:
        if len(os.sched_getaffinity(0)) < 2:
            raise ConfigError("kvq bench microbatch needs 2 CPUs (coordinator and worker)")
        if not 2 <= self.microbatches <= min(8, self.sequences):
            raise ConfigError("--microbatches must be in 2..min(8, --sequences)")
        if self.rtt_ms < 0 or self.pairs < 1 or self.warmup_steps < 0 or self.max_tokens < 2:
            raise ConfigError("--rtt-ms >= 0, --pairs >= 1, --warmup-steps >= 0, --max-tokens >= 2")
        if self.dispatch_policy not in ("capacity", "copies"):
            raise ConfigError("--policy is capacity or copies")


def run_microbatch_bench(cfg: MicrobatchBench) -> dict[str, Any]:
    cfg.check()
    mine = os.sched_getaffinity(0)
    coord_cpu, worker_cpu = sorted(mine)[:2]
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="kvq-mb-") as tmp:
            os.sched_setaffinity(0, {worker_cpu})  # Redis and the worker inherit it
            with EmbeddedRedis() as server:
                return _run(cfg, tmp, server.url, coord_cpu, worker_cpu)
    finally:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(threads)


def _run(
    cfg: MicrobatchBench, tmp: str, url: str, coord_cpu: int, worker_cpu: int
) -> dict[str, Any]:
    model = cfg.model or str(Path(tmp) / "model.gguf")
    if cfg.model is None:
        make_tiny(model, **DEFAULT_MODEL)  # type: ignore[arg-type]
    meta = read_meta(model)
    s = load_settings(
        redis_url=url,
        prefix="kvqmb",
        n_slots=cfg.sequences,
        base_replicas=1,
        slice_layers=meta.block_count,
        slice_experts=max(1, meta.expert_count // 2),
        idle_shutdown_s=0,
        idle_release_s=0,
        microbatches=cfg.microbatches,
        worker_max_slices=1,  # the worker holds half of every layer's experts: one slice
        dispatch_policy=cfg.dispatch_policy,
    )
    Monitor.from_settings(s).register(MODEL_ID, model)
    host, port = _host_port(url)
    proxy = DelayProxy(host, port, cfg.rtt_ms) if cfg.rtt_ms > 0 else None
    wurl = url if proxy is None else f"redis://127.0.0.1:{proxy.port}/0"
    env = child_env(s) | {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "KVQ_REDIS_URL": wurl}
    kids = Children(env, log_dir=cfg.log_dir or str(Path(tmp) / "logs"))
    try:
        kids.spawn("worker", "worker", "--id", "mb-worker", cpus={worker_cpu})
        coord = Coordinator.from_settings(s, "mb-coord", MODEL_ID, model)
        kids.wait_for(
            lambda: any(v.ready for v in coord.board.workers(MODEL_ID)),
            900,
            "the worker to load its slice",
        )
        os.sched_setaffinity(0, {coord_cpu})
        torch.set_num_threads(1)
        times = _steps(cfg, coord)
    finally:
        kids.stop_all()
        if proxy is not None:
            proxy.close()
    return _report(cfg, times) | {"cpus": {"coordinator": coord_cpu, "worker": worker_cpu}}


def _steps(cfg: MicrobatchBench, coord: Coordinator) -> dict[int, list[tuple[float, bool, int]]]:
    """Per arm (micro-batches), per measured step: (ms, decode only, remote jobs sent)."""
    eng, d = coord.engine, coord.dispatch
    n = [0]

    def refill() -> None:
        while eng.free:
            prompt = coord.tokenizer.encode(f"Request {n[0]}: the quick brown fox")
            eng.admit(f"r{n[0]}", prompt, cfg.max_tokens, b"")
            n[0] += 1

    out: dict[int, list[tuple[float, bool, int]]] = {1: [], cfg.microbatches: []}
    for i in range(cfg.warmup_steps + 2 * cfg.pairs):
        refill()
        # alternate which arm goes first in a pair, so neither always follows the other
        arm = (1, cfg.microbatches)[(i + (i // 2)) % 2]
        decode = all(len(s.next_input) == 1 for s in eng.active)
        sent0 = d.stats.remote_sent
        t0 = time.perf_counter()
        eng.step(d.for_step(cfg.sequences, cfg.sequences, arm), lambda _: None)
        ms = (time.perf_counter() - t0) * 1000
        if i >= cfg.warmup_steps:
            out[arm].append((ms, decode, d.stats.remote_sent - sent0))
    return out


def _report(
    cfg: MicrobatchBench, times: dict[int, list[tuple[float, bool, int]]]
) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm, rows in times.items():
        dec = [ms for ms, only, _ in rows if only]
        arms[str(arm)] = {
            "steps": len(rows),
            "mean_ms": round(statistics.fmean(ms for ms, _, _ in rows), 2),
            "decode_steps": len(dec),
            "decode_median_ms": round(statistics.median(dec), 2) if dec else None,
            "remote_jobs_per_step": round(statistics.fmean(r for _, _, r in rows), 2),
        }
    one, many = arms["1"], arms[str(cfg.microbatches)]
    dec_ratio = (
        round(many["decode_median_ms"] / one["decode_median_ms"], 3)
        if one["decode_median_ms"] and many["decode_median_ms"]
        else None
    )
    return {
        "model": cfg.model or f"generated {DEFAULT_MODEL}",
        "rtt_ms": cfg.rtt_ms,
        "policy": cfg.dispatch_policy,
        "sequences": cfg.sequences,
        "microbatches": cfg.microbatches,
        "arms": arms,
        "mean_ratio": round(many["mean_ms"] / one["mean_ms"], 3),
        "decode_median_ratio": dec_ratio,
    }
