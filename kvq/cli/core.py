"""Commands of the running system: config, monitor, coordinator, worker, submit, demo, server."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvq.api.limits import MAX_TEMPERATURE
from kvq.cli.common import (
    COUNT,
    EXIT_FAIL,
    EXIT_OK,
    PORT,
    node_id,
    number,
    redis_url,
    stop_on_signals,
)
from kvq.config import Settings, describe
from kvq.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from kvq.bus.redis_board import RedisBoard
    from kvq.monitor import Monitor
    from kvq.monitor.coarse import CoarseJobs
    from kvq.wire import ReplyEvent

log = logging.getLogger("kvq.cli")
Subparsers = Any  # argparse's _SubParsersAction is private


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "check":
        n = len(Settings.model_fields)
        print(json.dumps({"valid": True, "settings": n}) if args.json else "settings are valid")
        return EXIT_OK
    rows = describe(settings)
    if args.json:
        print(json.dumps({r["name"]: r["value"] for r in rows}, indent=2, default=str))
    else:
        for r in rows:
            print(f"{r['env']:<28} {r['value']!s:<28} {r['description']}")
    return EXIT_OK


def cmd_monitor(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bus.redis_board import open_board
    from kvq.gguf.remote import check_source
    from kvq.monitor import Monitor

    models = _model_flags(args.model or [])
    if args.source is not None:
        check_source(args.source, "--source")
    board = open_board(settings.bus, settings.lifetimes)
    mon = Monitor.on_redis(board, settings.monitor, monitor_id=args.id)
    stop_on_signals(mon.stop)
    server, jobs = None, None
    # every check of the start (the HTTP port above all) before any model is registered
    if settings.http_port:
        from kvq.monitor.http import serve_api

        server, _ = serve_api(
            board,
            settings.http_host,
            settings.http_port,
            settings.http_volunteer,
            settings.monitor_tokens,
            settings.monitor_history_s,
        )
        host, port = server.server_address[:2]
        log.info("dashboard, HTTP API and /metrics on http://%s:%s/", host, port)
    try:
        jobs = _register_models(models, args.source, settings, board, mon)
        mon.run()
    finally:
        if jobs is not None:
            jobs.close()
        if server is not None:
            server.shutdown()
            server.server_close()
    return EXIT_OK


def _model_flags(specs: list[str]) -> list[tuple[str, str, str | None]]:
    """The monitor's `--model ID=PATH` flags, each file's header read: (model id, path,
    source) triples. A PATH that is an http(s) URL (`#sha256=HEX` optional) is pulled first
    (`kvq model pull`: resumed, checked) and is the source workers fetch from."""
    from kvq.gguf import read_meta
    from kvq.gguf.remote import is_http, pull, pull_target

    models = []
    for spec in specs:
        model, _, path = spec.partition("=")
        if not path:
            raise ConfigError(f"--model wants ID=PATH, got {spec!r}")
        source = None
        if is_http(path):
            source, sha256, out = pull_target(path)
            got = pull(source, out, sha256)
            log.info(
                "pulled %s to %s (%d bytes, sha256 %s)", source, got.path, got.nbytes, got.sha256
            )
            path = got.path
        try:
            meta = read_meta(path)  # a bad file fails here, at once; checksums: a coarse job
        except (OSError, ModelError) as exc:  # a wrong flag value: usage (exit 2)
            raise ConfigError(f"--model {spec}: {exc}") from None
        if not meta.holds_experts:
            raise ConfigError(
                f"--model {spec}: {path!r} is a backbone file (kvq model split --backbone): "
                "workers could not fetch the experts from it; register the full file it was "
                "split from, and start the coordinator on the backbone file"
            )
        models.append((model, path, source))
    return models


def _register_models(
    models: list[tuple[str, str, str | None]],
    source: str | None,
    settings: Settings,
    board: RedisBoard,
    mon: Monitor,
) -> CoarseJobs | None:
    """Each model registered, inline or as an RQ job where `KVQ_RQ_URL` is set: the jobs'
    queue (None inline), to close once the monitor stops."""
    from kvq.monitor import coarse

    jobs = None
    if settings.coarse_url:
        jobs = coarse.CoarseJobs(settings.coarse_url, settings.prefix, mon.id)
        jobs.serve(board)
    elif models:
        log.info(
            "KVQ_RQ_URL is unset and KVQ_REDIS_URL is no standalone server: registering "
            "inline (RQ needs a standalone Redis)"
        )
    m = settings.monitor
    for model, path, pulled_from in models:
        if jobs is None:
            mon.register(model, path, source or pulled_from)
            continue
        job = jobs.enqueue(
            coarse.register_model,
            model,
            path,
            source or pulled_from,
            m.slice_layers,
            m.slice_experts,
            m.base_replicas,
            m.request_shards,
            m.grain,
            m.stage_layers,
        )
        log.info("registering %s: RQ job %s on queue %s", model, job.id, jobs.queue.name)
        mon.registering.append(model)
    return jobs


def cmd_coordinator(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.coordinator import Coordinator

    coord = Coordinator.from_settings(
        settings, node_id(args.id, "coord"), args.model_id, args.model
    )
    stop_on_signals(coord.stop)
    coord.run()
    return EXIT_OK


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.security.identity import default_worker_id
    from kvq.worker import Worker

    worker = Worker.from_settings(settings, args.id or default_worker_id(settings.state_dir))
    stop_on_signals(worker.stop)
    worker.run()
    return EXIT_OK


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from kvq import client, wire
    from kvq.bus import connect
    from kvq.bus.redis_board import open_board
    from kvq.client import RequestFailed
    from kvq.keys import Keys

    r, keys = connect(settings.bus), Keys(settings.prefix)
    if len(args.stop or []) > wire.MAX_STOPS:
        raise ConfigError(f"--stop: at most {wire.MAX_STOPS} stop strings, got {len(args.stop)}")
    board = open_board(settings.bus, settings.lifetimes)
    if not _served(board, args.model):  # the API's 503 rule
        registered = args.model in board.models()
        raise RequestFailed(
            f"no coordinator serves model {args.model!r} right now"
            + ("" if registered else f" (it is not registered under prefix {keys.prefix!r})")
        )
    sampling = wire.SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cancels it too
    done, lost = threading.Event(), threading.Event()
    # the id is chosen here, so that a Ctrl-C at any point after the request may have been
    # queued (even inside submit) cancels it: a cancel of an id never queued is harmless
    rid = uuid.uuid4().hex
    try:
        queued, entry = client.submit(
            r,
            keys,
            args.model,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            sampling=sampling,
            request_id=rid,
        )
        threading.Thread(target=_watch, args=(board, args.model, done, lost), daemon=True).start()
        events = client.events(r, keys, queued, timeout_s=args.timeout, entry=entry)
        ids, text, finish = _print_reply(events, args.json)
        done.set()
    except (KeyboardInterrupt, TimeoutError):
        done.set()
        client.cancel(r, keys, args.model, rid)  # free the slot now, not at max_tokens
        if lost.is_set():
            raise RequestFailed(
                f"no coordinator serves model {args.model!r} any more: request {rid} cancelled"
            ) from None
        raise
    out = {"request_id": rid, "token_ids": ids, "text": text, "finish": finish}
    print(json.dumps(out) if args.json else "")
    return EXIT_OK


def _print_reply(events: Iterable[ReplyEvent], as_json: bool) -> tuple[list[int], str, Any]:
    """Each token printed as it comes (nothing with `--json`): the token ids, the final text
    and the finish reason."""
    ids: list[int] = []
    text, finish, shown = "", None, ""
    for ev in events:
        if ev.kind == "token" and ev.token_id is not None:
            ids.append(ev.token_id)
            shown += ev.text
            if not as_json:
                print(ev.text, end="", flush=True)
        elif ev.kind == "done":
            text, finish = ev.text, ev.finish
            if not as_json and text.startswith(shown):  # text held back until the end
                print(text[len(shown) :], end="", flush=True)
    return ids, text, finish


def _served(board: Any, model: str) -> bool:
    return any(c.alive for c in board.coordinators(model))


def _watch(board: Any, model: str, done: threading.Event, lost: threading.Event) -> None:
    """While `kvq submit` waits: once no coordinator of `model` is alive (a clean stop leaves
    at once), stop the wait within a second, as the API's 503 does."""
    import _thread

    import redis

    while not done.wait(0.5):
        try:
            alive = _served(board, model)
        except redis.RedisError:
            continue  # the reply read says so itself
        if not alive and not done.is_set():
            lost.set()
            _thread.interrupt_main()
            return


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.demo import DemoOptions, run_demo

    opts = DemoOptions(
        redis_url=args.redis,
        model_path=args.model,
        workers=args.workers,
        requests=args.requests,
        max_tokens=args.max_tokens,
        log_dir=args.log_dir,
        cluster=args.cluster,
        acl=args.acl,
    )

    def say(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    summary = run_demo(settings, opts, say)
    if args.json:
        print(json.dumps(summary))
    else:
        print("\nsummary")
        for k, v in summary.items():
            print(f"  {k:<24} {v}")
    return EXIT_OK if summary["remote_matches_local"] else EXIT_FAIL


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.bus import run_bus_bench

    if args.cluster:
        from kvq.tools.bench.cluster import run_cluster_bench

        out = run_cluster_bench(args.cluster, args.seconds)
        print(json.dumps(out) if args.json else "\n".join(f"{k:<20} {v}" for k, v in out.items()))
        return EXIT_OK
    result = run_bus_bench(settings, jobs=args.jobs, redis_url=args.redis)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("kvq", "raw", "rq"):
            r = result[name]
            print(
                f"{name:<4} {r['jobs_per_s']:>10.0f} jobs/s  p50 {r['p50_ms']:.3f} ms  "
                f"p99 {r['p99_ms']:.3f} ms"
            )
        print(
            f"ratio_vs_raw_batched {result['ratio_vs_raw_batched']:.2f}  "
            f"ratio_vs_rq {result['ratio_vs_rq']:.1f}"
        )
    return EXIT_OK


def cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.local.server import EmbeddedRedis

    stop = threading.Event()
    stop_on_signals(stop)
    if args.cluster:
        from kvq.local.cluster import EmbeddedCluster

        with EmbeddedCluster(args.cluster, args.cluster_replicas, data_dir=args.dir) as cl:
            print(cl.url, flush=True)  # KVQ_REDIS_URL for every kvq process
            stop.wait()
        return EXIT_OK
    with EmbeddedRedis(port=args.port, data_dir=args.dir, persist=args.dir is not None) as srv:
        print(srv.url, flush=True)
        stop.wait()
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------


def register(sub: Subparsers, bench: Subparsers) -> None:
    """config, monitor, coordinator, worker, submit, demo, server, bench bus."""
    _add_config(sub)
    _add_monitor(sub)
    _add_coordinator(sub)
    _add_worker(sub)
    _add_submit(sub)
    _add_demo(sub)
    _add_server(sub)
    _add_bench_bus(bench)


def _add_config(sub: Subparsers) -> None:
    c = sub.add_parser("config", help="show or check the effective settings")
    c.add_argument("action", choices=["show", "check"], help="print the settings, or check them")
    c.add_argument("--json", action="store_true", help="print JSON (for machines)")
    c.set_defaults(fn=cmd_config, kernels=False)


def _add_monitor(sub: Subparsers) -> None:
    mon = sub.add_parser("monitor", help="run the control plane")
    mon.add_argument(
        "--model",
        action="append",
        metavar="ID=PATH",
        help="register a model (PATH may be an http(s) URL: pulled first)",
    )
    mon.add_argument("--source", help="URL workers download the model from (default: PATH)")
    mon.add_argument("--id", help="monitor id for the lease (default monitor-HOSTNAME-PID)")
    mon.set_defaults(fn=cmd_monitor)


def _add_coordinator(sub: Subparsers) -> None:
    co = sub.add_parser("coordinator", help="run a coordinator for one model")
    co.add_argument("--model", required=True, help="GGUF file")
    co.add_argument("--model-id", required=True, help="registered model id")
    co.add_argument("--id", help="coordinator id (default coord-HOSTNAME)")
    co.set_defaults(fn=cmd_coordinator)


def _add_worker(sub: Subparsers) -> None:
    w = sub.add_parser("worker", help="run a worker (outbound connections only)")
    w.add_argument(
        "--id", help="worker id: 1-64 of A-Z a-z 0-9 _ . - (default: HOSTNAME-<kept suffix>)"
    )
    w.set_defaults(fn=cmd_worker)


def _add_submit(sub: Subparsers) -> None:
    s = sub.add_parser("submit", help="send a prompt and stream the completion")
    s.add_argument("--model", required=True, help="registered model id")
    s.add_argument("--prompt", required=True, help="text, encoded by the coordinator")
    s.add_argument("--max-tokens", type=COUNT, default=16, help="tokens to generate (>= 1)")
    s.add_argument(
        "--temperature",
        type=number(0, MAX_TEMPERATURE),
        default=0.0,
        help=f"0..{MAX_TEMPERATURE:g}, as the API; 0 = greedy (default)",
    )
    s.add_argument(
        "--top-p", type=number(0, 1, lo_open=True), default=1.0, help="nucleus sampling, in (0, 1]"
    )
    s.add_argument("--top-k", type=number(0, 1 << 20, int), default=0, help="0 = no limit")
    s.add_argument("--seed", type=int, help="reproducible sampling")
    s.add_argument("--stop", action="append", help="stop string (repeatable, up to 4)")
    s.add_argument(
        "--timeout",
        type=number(0, 86400, lo_open=True),
        default=120.0,
        help="seconds to wait for the whole completion",
    )
    s.add_argument("--json", action="store_true", help="print JSON (for machines)")
    s.set_defaults(fn=cmd_submit, kernels=False)


def _add_demo(sub: Subparsers) -> None:
    d = sub.add_parser("demo", help="run everything on this machine and summarise")
    d.add_argument("--redis", type=redis_url, help="Redis URL (default: start an embedded server)")
    d.add_argument("--model", help="GGUF file (default: make a tiny one)")
    d.add_argument("--workers", type=number(0, 64, int), default=2, help="workers to start")
    d.add_argument("--requests", type=COUNT, default=16, help="requests to send")
    d.add_argument("--max-tokens", type=COUNT, default=32, help="tokens per request")
    d.add_argument("--log-dir", help="write each process's log here")
    d.add_argument(
        "--cluster",
        type=number(0, 16, int),
        default=0,
        metavar="N",
        help="run on a local Redis Cluster of N masters (not with --redis)",
    )
    d.add_argument("--json", action="store_true", help="print JSON (for machines)")
    d.add_argument(
        "--acl",
        action="store_true",
        help="run each process as its role's least-privilege ACL user (kvq acl)",
    )
    d.set_defaults(fn=cmd_demo)


def _add_server(sub: Subparsers) -> None:
    sv = sub.add_parser("server", help="run an embedded Redis server in the foreground")
    sv.add_argument("--port", type=PORT, default=6379, help="port on 127.0.0.1 (0 = any free)")
    sv.add_argument("--dir", help="data directory (persists across restarts)")
    sv.add_argument(
        "--cluster",
        type=number(0, 16, int),
        default=0,
        metavar="N",
        help="a local Redis Cluster of N masters on free ports instead",
    )
    sv.add_argument(
        "--cluster-replicas",
        type=number(0, 4, int),
        default=0,
        metavar="R",
        help="with --cluster: R replicas per master",
    )
    sv.set_defaults(fn=cmd_server, kernels=False)


def _add_bench_bus(bench: Subparsers) -> None:
    bb = bench.add_parser("bus", help="expert job round trips: kvq vs raw redis-py vs RQ")
    bb.add_argument("--jobs", type=COUNT, default=2000, help="jobs per side")
    bb.add_argument("--redis", type=redis_url, help="Redis URL (default: start an embedded server)")
    bb.add_argument(
        "--cluster",
        type=number(0, 16, int),
        default=0,
        metavar="N",
        help="instead: N pairs over a local N-master cluster vs one server",
    )
    bb.add_argument(
        "--seconds",
        type=number(0, 3600, lo_open=True),
        default=5.0,
        help="with --cluster: each run's length",
    )
    bb.add_argument("--json", action="store_true", help="print JSON (for machines)")
    bb.set_defaults(fn=cmd_bench)
