"""`kvq demo`: the whole system on one machine, a load burst and its drain, then a summary.

Starts an embedded Redis (unless a URL is given), makes a tiny MoE model (unless one is given),
runs a monitor, a coordinator (verifying every remote result against local compute) and N
workers as separate processes, sends a burst that saturates the coordinator, waits for the
monitor to see it drain, and stops everything it started, also on Ctrl-C or a child's death.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from kvq import client, wire
from kvq.bus import redacted_url
from kvq.bus.records import CoordStats
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, child_env
from kvq.errors import ChildDied, KvqError
from kvq.gguf import read_meta
from kvq.keys import request_streams
from kvq.local.cluster import EmbeddedCluster
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis
from kvq.tools.demo_acl import DemoUsers
from kvq.tools.synth import make_tiny

MODEL_ID = "tiny"
COORD_ID = "coord-demo"


@dataclass
class DemoOptions:
    redis_url: str | None = None
    model_path: str | None = None
    workers: int = 2
    requests: int = 16
    max_tokens: int = 32
    timeout_s: float = 120.0
    log_dir: str | None = None
    cluster: int = 0  # > 0: a local Redis Cluster of this many masters instead of one server
    acl: bool = False  # each process under its role's least-privilege ACL user (kvq.tools.demo_acl)


def run_demo(settings: Settings, opts: DemoOptions, say: Any = print) -> dict[str, Any]:
    """Run the demo; returns the summary (the `--json` document)."""
    t0 = time.monotonic()
    server = _start_server(opts)
    url = opts.redis_url or (server.url if server else "")
    tmp = tempfile.TemporaryDirectory(prefix="kvq-demo-")
    children: Children | None = None
    users: DemoUsers | None = None
    try:
        say(f"redis: {'embedded at ' + url if server else redacted_url(url)}")
        model_path = _model_path(opts, tmp.name, say)
        s = settings.model_copy(update={"redis_url": url})
        env = _demo_env(s, model_path)
        children = Children(env, log_dir=opts.log_dir)
        board = open_board(s.bus, s.lifetimes)
        _flush_prefix(board)
        wids = [f"worker-{i}" for i in range(opts.workers)]
        if opts.acl:
            users = DemoUsers.make(board.r, board.keys, url, wids)
            say(f"ACL users: {', '.join(users.names)}")
        _spawn_roles(children, board, env, users, model_path, wids)
        _wait_ready(children, board, opts.workers, s.base_replicas)
        say(f"{opts.workers} workers volunteered; sending a burst of {opts.requests} requests")
        burst = _client_burst(board, users, opts, children)
        say("burst done; waiting for the monitor to see the load drain")
        children.wait_for(
            lambda: _stats(board).completed >= opts.requests, 30, "final coordinator stats"
        )
        children.wait_for(lambda: not _saturated(board), 30, "drain")
        label = "embedded" if server and not opts.cluster else redacted_url(url)
        summary = _summary(
            board, burst, f"cluster of {opts.cluster}" if opts.cluster else label, t0
        )
        if users is not None:
            summary["acl_denials"] = users.denials()
        return summary
    finally:
        if children is not None:
            children.stop_all()
        if users is not None:
            users.drop()
        if server is not None:
            server.close()
        tmp.cleanup()


def _start_server(opts: DemoOptions) -> EmbeddedRedis | EmbeddedCluster | None:
    """An embedded server or cluster, unless the demo runs against a given URL."""
    if opts.cluster:
        return EmbeddedCluster(opts.cluster).start()
    if not opts.redis_url:
        return EmbeddedRedis().start()
    return None


def _model_path(opts: DemoOptions, tmp_dir: str, say: Any) -> str:
    """The given model, or a tiny MoE model made in `tmp_dir`."""
    model_path = opts.model_path or str(Path(tmp_dir) / "tiny.gguf")
    if not opts.model_path:
        make_tiny(model_path, layers=2, experts=8, experts_used=2)
        say(f"made a tiny MoE model: {model_path}")
    return model_path


def _demo_env(s: Settings, model_path: str) -> dict[str, str]:
    """The children's environment: settings tuned so a short demo shows every mechanism."""
    env = child_env(
        s,
        hot_gib=_quarter_of_experts_gib(model_path) if s.hot_gib is None else s.hot_gib,
        verify_remote="all",
        heartbeat_ttl_s=3.0,
        monitor_poll_s=0.1,
        idle_shutdown_s=0,
        job_deadline_ms=max(s.job_deadline_ms, 3000),
        slot_poll_s=0.05,
        dyn_steps=min(s.dyn_steps, 4),  # a short demo: let dynamic swaps show
        saturation_enter_s=min(s.saturation_enter_s, 0.2),  # and boosts come and go (a
        # burst of 16 short requests can be over in 2 s on a fast machine)
        saturation_leave_s=min(s.saturation_leave_s, 2.0),
        # the tiny model's experts cost less than a round trip, so the default capacity
        # split would keep them local; whole copies show the remote path (docs/routing.md)
        dispatch_policy="copies",
        # one slice a worker (unless set): the demo shows several workers recruited, where
        # one worker's budget would fit every slice of the tiny model
        worker_max_slices=s.worker_max_slices or 1,
    )
    # several torch processes share this machine's cores: one thread each avoids OpenMP
    # threads spinning against each other
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _spawn_roles(
    children: Children,
    board: RedisBoard,
    env: dict[str, str],
    users: DemoUsers | None,
    model_path: str,
    wids: list[str],
) -> None:
    """Start the monitor, then (once it registered the model) the coordinator and workers."""

    def as_role(role: str) -> dict[str, str] | None:
        return None if users is None else env | {"KVQ_REDIS_URL": users.urls[role]}

    children.spawn(
        "monitor", "monitor", "--model", f"{MODEL_ID}={model_path}", env=as_role("monitor")
    )
    children.wait_for(lambda: MODEL_ID in board.models(), 30, "model registration")
    children.spawn(
        "coordinator",
        "coordinator",
        "--model-id",
        MODEL_ID,
        "--model",
        model_path,
        "--id",
        COORD_ID,
        env=as_role("coordinator"),
    )
    for w in wids:
        children.spawn(w, "worker", "--id", w, env=as_role(w))


def _wait_ready(children: Children, board: RedisBoard, workers: int, base_replicas: int) -> None:
    """Every worker that the base demand has room for takes its slice before the burst."""
    info = board.model_info(MODEL_ID)
    wanted = min(workers, (len(info.slices) if info else 0) * base_replicas)
    children.wait_for(
        lambda: _ready_workers(board) >= wanted, 60, "workers to volunteer and load their slices"
    )
    children.wait_for(lambda: board.coordinator_alive(COORD_ID), 60, "the coordinator")


def _client_burst(
    board: RedisBoard, users: DemoUsers | None, opts: DemoOptions, children: Children
) -> dict[str, Any]:
    """The burst, sent on the client's connection (its own ACL user when there are users)."""
    sender = redis.Redis.from_url(users.urls["client"]) if users else board.r
    try:
        return _burst(board, sender, opts, children)
    finally:
        if sender is not board.r:
            sender.close()


def _quarter_of_experts_gib(model_path: str) -> float:
    """A hot budget of a quarter of the experts, so the demo shows hot and cold hits (on a CPU
    the default budget is 0: no accelerator, every expert is read in place from RAM). Banks hold
    dequantized fp32 experts, so the budget counts those bytes, not the file's."""
    m = read_meta(model_path)
    per_layer = m.expert_count * 3 * m.embedding_length * m.expert_feed_forward_length * 4
    return m.block_count * per_layer / 4 / 2**30


def _ready_workers(board: RedisBoard) -> int:
    """Workers that have loaded a slice and whose heartbeat is up (each counted once)."""
    return len({v.worker_id for v in board.workers(MODEL_ID) if v.alive and v.ready})


def _stats(board: RedisBoard) -> CoordStats:
    return board.coord_stats(COORD_ID) or CoordStats()


def _saturated(board: RedisBoard) -> bool:
    state = board.model_state(MODEL_ID)
    return state is not None and state.saturated


def _flush_prefix(board: RedisBoard) -> None:
    """Remove keys of an earlier demo run on a shared server (our prefix only)."""
    for key in board.r.scan_iter(match=f"{board.keys.prefix}:*", count=1000):
        board.r.delete(key)


def _burst(
    board: RedisBoard, r: redis.Redis, opts: DemoOptions, children: Children
) -> dict[str, Any]:
    """The requests, sent and read on `r` (the client's connection)."""
    keys = board.keys
    prompts = [f"Request {i}: the quick brown fox jumps" for i in range(opts.requests)]
    t0 = time.monotonic()
    ids = [client.send(r, keys, MODEL_ID, prompt=p, max_tokens=opts.max_tokens) for p in prompts]
    peak_saturated = False
    done: dict[str, int] = {}
    cursors = dict.fromkeys(ids, b"0-0")
    deadline = time.monotonic() + opts.timeout_s
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"burst: {len(done)}/{len(ids)} requests done in {opts.timeout_s}s")
        if children.dead():
            raise ChildDied(f"{', '.join(children.dead())} exited during the burst")
        peak_saturated |= _saturated(board)
        # one XREAD per reply stream, pipelined: each has its own hash tag (a cluster spreads
        # them), so no one command may name several
        waiting = [i for i in ids if i not in done]
        pipe = r.pipeline(transaction=False)
        for i in waiting:
            pipe.xread({keys.request_reply(i): cursors[i]}, count=256)
        got = pipe.execute()
        if not any(got):
            time.sleep(0.02)
        for rid, resp in zip(waiting, got, strict=True):
            for eid, fields in resp[0][1] if resp else []:
                cursors[rid] = eid
                ev = wire.decode(fields, wire.ReplyEvent)
                if ev.kind == "done":
                    done[rid] = ev.index
                elif ev.kind == "error":
                    raise KvqError(f"request {rid} failed: {ev.error}")
    wall = time.monotonic() - t0
    tokens = sum(done.values())
    return {"requests": len(done), "tokens": tokens, "burst_s": wall, "saturated": peak_saturated}


def _summary(
    board: RedisBoard, burst: dict[str, Any], redis_label: str, t0: float
) -> dict[str, Any]:
    st = _stats(board)
    remote = st.remote_jobs
    return {
        "requests_completed": burst["requests"],
        "tokens_generated": burst["tokens"],
        "tokens_per_s": round(burst["tokens"] / burst["burst_s"], 1) if burst["burst_s"] else 0.0,
        "local_jobs": st.local_jobs,
        "remote_jobs": remote,
        "fallback_jobs": st.fallback_jobs,
        "late_results": st.late_results,
        "workers_recruited": len(board.assignments(MODEL_ID)),
        "saturated_during_burst": burst["saturated"],
        "remote_verified": st.verified,
        "hot_hit_rate": st.hot_hit_rate,
        "cold_hit_rate": st.cold_hit_rate,
        # trials and re-probes are verified too: at least every remote result was
        "remote_matches_local": remote > 0 and st.verified >= remote and st.mismatches == 0,
        "remote_max_abs_err": st.max_abs_err,
        "tolerance": "per row |remote - local| <= tol(dtype) * |local| (docs/security.md)",
        "redis": redis_label,
        "request_shards": board.shard_count(MODEL_ID),
        "request_nodes": _request_nodes(board),
        "wall_s": round(time.monotonic() - t0, 2),
    }


def _request_nodes(board: RedisBoard) -> int:
    """How many servers hold the model's request shards (a cluster's masters; else 1)."""
    if not board.cluster:
        return 1
    streams = request_streams(board.keys, MODEL_ID, board.shard_count(MODEL_ID))
    return len({board.r.get_node_from_key(s).name for s in streams})
