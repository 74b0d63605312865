"""`kvq bench offload`: does a worker make the coordinator faster?

Real processes on one machine: a coordinator pinned to CPU 0 and, in the offload runs, one
worker pinned to CPU 1, each with one torch thread; the embedded Redis, the monitor and the
client loops share CPU 1 (light work that runs while the worker waits for jobs). The model's experts
are cut into two slices (every layer, half the experts each); the worker volunteers for one.
A closed loop of `sequences` clients keeps the coordinator saturated; after `warmup_s` the
tokens streamed back during `measure_s` give the aggregate tok/s.

- one run per `--rtt-ms` value (each `--repeat` times): a fresh worker that reaches Redis
  through a `DelayProxy` adding that round trip (0: directly); `remote_share` = the
  coordinator's remote jobs / all expert jobs in the window;
- baseline: no worker (all-local on one CPU), measured before the first run and again after
  each run (the worker gone). The machine drifts (two baselines minutes apart differed by 22%
  on a shared VM), so a run's `speedup` is its tok/s over the mean of the two baselines
  beside it, and `summary` gives each (RTT, micro-batches) pair's median over its repeats;
- with several `--microbatches` values, each RTT gets one run per value, side by side, each
  with a coordinator started with that `KVQ_MICROBATCHES` (micro-batches change nothing
  without a worker, so the baseline is shared).

`expert_share`: the coordinator's seconds computing expert slices (`local_expert_s`) over the
window; `wait_share`: its layers' seconds waiting for remote results (`remote_wait_s`);
`send_share`: its seconds making, encoding and sending remote jobs (`remote_send_s`);
`local_ms_per_row`: its expert seconds per token row it computed (`local_rows`), which tells a
dearer row (a busy neighbour) from a dearer mix of jobs (prefill kept, decode sent). With
the baseline's expert share e, `split_bound` = 1 / (1 - e / 2) is the most a worker taking one
of the two slices can give when each layer waits for its remote part: the coordinator still
computes the backbone and the other half of the experts every step (a free, instant worker).

Default settings otherwise (the capacity split, `KVQ_DISPATCH_POLICY=capacity`).
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq import client
from kvq.bus import connect
from kvq.bus.records import CoordStats
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, child_env, load_settings
from kvq.errors import ConfigError, KvqError
from kvq.gguf.meta import read_meta
from kvq.keys import Keys
from kvq.local.cluster import local_redis
from kvq.local.procs import Children
from kvq.tools.synth import make_tiny

from .delay_proxy import DelayProxy

MODEL_ID = "bench"
COORD_ID = "bench-coord"
# when no --model is given: 8 layers, 32 experts top-4, hidden 1024, Q4_K (about 240 MB)
DEFAULT_MODEL = {
    "layers": 8,
    "experts": 32,
    "experts_used": 4,
    "hidden": 1024,
    "expert_ffn": 512,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 128,
    "quant": "q4_k",
}


@dataclass(frozen=True)
class OffloadBench:
    model: str | None = None  # a GGUF file; None: DEFAULT_MODEL written to a temp dir
    rtts_ms: tuple[float, ...] = (0.0,)
    microbatches: tuple[int, ...] = (1,)
    sequences: int = 8
    max_tokens: int = 16
    warmup_s: float = 10.0
    measure_s: float = 30.0
    log_dir: str | None = None
    cluster: int = 0  # > 0: on a local Redis Cluster of that many masters
    repeat: int = 1  # rounds over every (RTT, micro-batches) pair

    def check(self) -> None:
        if self.cluster and any(r > 0 for r in self.rtts_ms):
            raise ConfigError(
                "--cluster runs at --rtt-ms 0 only (the delaying proxy fronts one server; a "
                "cluster client follows redirects to every node)"
            )
        if len(os.sched_getaffinity(0)) < 2:
            raise ConfigError(
                "kvq bench offload needs 2 CPUs (coordinator and worker pinned apart)"
            )
        if (
            self.sequences < 2
            or self.max_tokens < 1
            or self.measure_s <= 0
            or self.warmup_s < 0
            or self.repeat < 1
        ):
            raise ConfigError(
                "--sequences >= 2, --max-tokens >= 1, --measure-s > 0, --warmup-s >= 0, "
                "--repeat >= 1"
            )
        if not self.microbatches or any(
            not 1 <= m <= min(8, self.sequences) for m in self.microbatches
        ):
            raise ConfigError(
                f"--microbatches values must be in 1..min(8, --sequences), "
                f"got {list(self.microbatches)}"
            )
        if any(r < 0 for r in self.rtts_ms):
            raise ConfigError(f"--rtt-ms values must be >= 0, got {list(self.rtts_ms)}")


def run_offload_bench(cfg: OffloadBench) -> dict[str, Any]:
    cfg.check()
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    coord_cpu, worker_cpu = cpus[0], cpus[1]
    # the coordinator has its CPU to itself; Redis, the monitor and the clients share the
    # worker's. They are light and mostly run while the worker waits for a job (measured: with
    # Redis on the coordinator's CPU a worker's round trip cost 6-13 ms, as Redis waited for
    # the coordinator's compute to yield)
    os.sched_setaffinity(0, {worker_cpu})
    try:
        return _run(cfg, coord_cpu, worker_cpu)
    finally:
        os.sched_setaffinity(0, mine)


def _run(cfg: OffloadBench, coord_cpu: int, worker_cpu: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="kvq-offload-") as tmp,
        local_redis(cfg.cluster) as server,
    ):
        model = cfg.model or str(Path(tmp) / "model.gguf")
        if cfg.model is None:
            make_tiny(model, **DEFAULT_MODEL)  # type: ignore[arg-type]
        meta, file_mb = read_meta(model), Path(model).stat().st_size / 1e6
        s = load_settings(
            redis_url=server.url,
            prefix="kvqbench",
            n_slots=cfg.sequences,
            slice_layers=meta.block_count,
            slice_experts=max(1, meta.expert_count // 2),
            max_tokens_limit=max(512, cfg.max_tokens),
            idle_shutdown_s=0,
            idle_release_s=0,
            worker_max_slices=1,  # the worker volunteers for one of the two slices
        )
        env = child_env(s) | {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        kids = Children(env, log_dir=cfg.log_dir or str(Path(tmp) / "logs"))
        try:
            baselines, runs = _measure(cfg, s, kids, model, coord_cpu, worker_cpu)
        finally:
            kids.stop_all()
    return _report(cfg, file_mb, coord_cpu, worker_cpu, baselines, runs)


def _measure(
    cfg: OffloadBench, s: Settings, kids: Children, model: str, coord_cpu: int, worker_cpu: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (RTT, micro-batches) run with a worker, each between two phases without one: the
    phases and the runs."""
    board = open_board(s.bus, s.lifetimes)
    kids.spawn("monitor", "monitor", "--model", f"{MODEL_ID}={model}", cpus={worker_cpu})
    kids.wait_for(lambda: MODEL_ID in board.models(), 600, "model registration")
    coord = _coordinator(kids, board, model, cfg.microbatches[0], coord_cpu)
    baselines = [_phase(board, s, cfg, kids, coord)]
    runs = []
    rounds = itertools.product(  # micro-batch values side by side: the machine drifts
        range(cfg.repeat), enumerate(cfg.rtts_ms), enumerate(cfg.microbatches)
    )
    for k, (i, rtt), (j, mb) in rounds:
        if not coord.endswith(f"-mb{mb}"):
            coord = _coordinator(kids, board, model, mb, coord_cpu)
        name = f"{i}-{j}" + (f"-{k}" if cfg.repeat > 1 else "")
        run = _with_worker(board, s, cfg, kids, coord, name, rtt, worker_cpu)
        baselines.append(_phase(board, s, cfg, kids, coord))
        beside = (baselines[-2]["tok_s"] + baselines[-1]["tok_s"]) / 2
        speedup = round(run["tok_s"] / beside, 3) if beside else None
        runs.append(
            {"rtt_ms": rtt, "microbatches": mb, "repeat": k}
            | run
            | {"baseline_tok_s": round(beside, 3), "speedup": speedup}
        )
    return baselines, runs


def _report(
    cfg: OffloadBench,
    file_mb: float,
    coord_cpu: int,
    worker_cpu: int,
    baselines: list[dict[str, Any]],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The `--json` document."""
    base = statistics.mean(b["tok_s"] for b in baselines)
    e = statistics.mean(b["expert_share"] for b in baselines)
    return {
        "model": cfg.model or f"generated {DEFAULT_MODEL}",
        "file_mb": round(file_mb, 1),
        "sequences": cfg.sequences,
        "microbatches": list(cfg.microbatches),
        "max_tokens": cfg.max_tokens,
        "warmup_s": cfg.warmup_s,
        "measure_s": cfg.measure_s,
        "cpus": {"coordinator": coord_cpu, "worker": worker_cpu},
        "baseline": {
            "tok_s": round(base, 3),
            "expert_share": round(e, 3),
            "before": baselines[0],
            "after": baselines[-1],
            "phases": baselines,
        },
        "split_bound": round(1 / (1 - e / 2), 3),
        "runs": runs,  # e is a share: <= 1
        "summary": _summary(runs),
        "repeat": cfg.repeat,
    }


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (RTT, micro-batches) pair, in run order: the median speed-up (of the runs that have
    one: none without a baseline tok/s) and remote share over its repeats, and each repeat's
    speed-up."""
    pairs: dict[tuple[float, int], list[dict[str, Any]]] = {}
    for run in runs:
        pairs.setdefault((run["rtt_ms"], run["microbatches"]), []).append(run)
    return [
        {
            "rtt_ms": rtt,
            "microbatches": mb,
            "speedup_median": _median([r["speedup"] for r in rs if r["speedup"] is not None]),
            "speedups": [r["speedup"] for r in rs],
            "remote_share_median": _median([r["remote_share"] for r in rs]),
        }
        for (rtt, mb), rs in pairs.items()
    ]


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _coordinator(kids: Children, board: RedisBoard, model: str, mb: int, cpu: int) -> str:
    """A coordinator with `mb` micro-batches (the previous one stopped first); its id."""
    for name in [n for n in kids.procs if n.startswith("coordinator")]:
        proc = kids.procs.pop(name)
        proc.terminate()
        proc.wait(60)
    coord = f"{COORD_ID}-mb{mb}"
    env = dict(kids.env) | {"KVQ_MICROBATCHES": str(mb)}
    kids.spawn(
        f"coordinator-mb{mb}",
        "coordinator",
        "--model-id",
        MODEL_ID,
        "--model",
        model,
        "--id",
        coord,
        cpus={cpu},
        env=env,
    )
    kids.wait_for(lambda: board.coordinator_alive(coord), 600, f"coordinator {coord}")
    return coord


def _with_worker(
    board: RedisBoard,
    s: Settings,
    cfg: OffloadBench,
    kids: Children,
    coord: str,
    i: str,
    rtt: float,
    cpu: int,
) -> dict[str, Any]:
    """One offload run: a fresh worker behind a proxy adding `rtt` ms, then the load."""
    host, port = _host_port(s.redis_url)
    proxy = DelayProxy(host, port, rtt) if rtt > 0 else None
    try:
        url = s.redis_url if proxy is None else f"redis://127.0.0.1:{proxy.port}/0"
        name = f"worker-{i}"
        env = dict(kids.env) | {"KVQ_REDIS_URL": url}
        t0 = time.monotonic()
        kids.spawn(name, "worker", "--id", name, cpus={cpu}, env=env)
        kids.wait_for(lambda: _ready(board, name), 900, f"{name} to load its slice")
        load_s = time.monotonic() - t0
        phase = _phase(board, s, cfg, kids, coord)
        proc = kids.procs.pop(name)
        proc.terminate()  # it leaves; the next run's worker takes the slice
        proc.wait(60)
        kids.wait_for(
            lambda: not any(v.worker_id == name for v in board.workers(MODEL_ID)),
            60,
            f"{name} to leave",
        )
        return phase | {"worker_load_s": round(load_s, 1)}
    finally:
        if proxy is not None:
            proxy.close()


def _phase(
    board: RedisBoard, s: Settings, cfg: OffloadBench, kids: Children, coord: str
) -> dict[str, Any]:
    """The closed loop of `cfg.sequences` clients; tok/s and job shares in the window."""
    loops = _ClientLoops(s, cfg)
    loops.start()
    time.sleep(cfg.warmup_s)
    start, st0 = time.monotonic(), board.coord_stats(coord)
    deadline = start + cfg.measure_s
    while time.monotonic() < deadline:
        if kids.dead():
            loops.stop.set()
            raise KvqError(f"{', '.join(kids.dead())} exited during the bench; see its log")
        time.sleep(0.2)
    end, st1 = time.monotonic(), board.coord_stats(coord)
    loops.finish()
    if loops.errors:
        raise KvqError(f"requests failed during the bench: {loops.errors[0]}")
    tokens = sum(start <= t < end for t in loops.stamps)
    return _phase_result(tokens, end - start, st0, st1)


class _ClientLoops:
    """`cfg.sequences` client threads, each sending its next request when the last one ends;
    the arrival time of every token streamed back, and the errors that ended a loop."""

    def __init__(self, s: Settings, cfg: OffloadBench) -> None:
        self.s, self.cfg = s, cfg
        self.stop = threading.Event()
        self.stamps: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True)
            for n in range(cfg.sequences)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)

    def _loop(self, n: int) -> None:
        r = connect(self.s.bus)  # any mode: standalone or cluster
        keys = Keys(self.s.prefix)
        k = 0
        try:
            while not self.stop.is_set():
                rid = client.send(
                    r,
                    keys,
                    MODEL_ID,
                    prompt=f"Request {n}.{k}: the quick brown fox",
                    max_tokens=self.cfg.max_tokens,
                )
                k += 1
                for ev in client.events(r, keys, rid, timeout_s=600):
                    if ev.kind == "token":
                        with self.lock:
                            self.stamps.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - any failure fails the bench, never a silent 0
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            r.close()


def _phase_result(
    tokens: int, window: float, st0: CoordStats | None, st1: CoordStats | None
) -> dict[str, Any]:
    """A phase's figures: `tokens` over `window` seconds, and the coordinator's stats grown
    from `st0` to `st1` over it."""

    def delta(field: str) -> Any:  # a counter's growth over the window (0 without stats)
        return getattr(st1, field) - getattr(st0, field) if st0 and st1 else 0

    local, remote, fallback = delta("local_jobs"), delta("remote_jobs"), delta("fallback_jobs")
    rows = delta("local_rows")
    jobs = local + remote + fallback
    return {
        "tok_s": round(tokens / window, 3),
        "tokens": tokens,
        "local_jobs": local,
        "remote_jobs": remote,
        "fallback_jobs": fallback,
        "remote_share": round(remote / jobs, 3) if jobs else 0.0,
        "microbatched_steps": delta("microbatched_steps"),
        "verified": delta("verified"),
        "trials_sent": delta("trials_sent"),
        "expert_share": round(delta("local_expert_s") / window, 3),
        "local_ms_per_row": round(1000 * delta("local_expert_s") / rows, 3) if rows else None,
        "wait_share": round(delta("remote_wait_s") / window, 3),
        "send_share": round(delta("remote_send_s") / window, 3),
    }


def _ready(board: RedisBoard, worker: str) -> bool:
    return any(v.worker_id == worker and v.alive and v.ready for v in board.workers(MODEL_ID))


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlparse

    u = urlparse(url)
    return u.hostname or "127.0.0.1", u.port or 6379
