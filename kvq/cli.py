"""`kvq` command line: parsing and printing only; the work happens in library calls.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or invalid settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence

from kvq.config import Settings, describe, load_settings
from kvq.errors import ConfigError, KvqError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _node_id(given: str | None, role: str) -> str:
    return given or f"{role}-{socket.gethostname()}"


# -- commands ------------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "check":
        print("settings are valid")
        return EXIT_OK
    rows = describe(settings)
    if args.json:
        print(json.dumps({r["name"]: r["value"] for r in rows}, indent=2, default=str))
    else:
        for r in rows:
            print(f"{r['env']:<28} {r['value']!s:<28} {r['description']}")
    return EXIT_OK


def cmd_model(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.model import make_tiny

    make_tiny(
        args.out, layers=args.layers, experts=args.experts, experts_used=args.experts_used,
        hidden=args.hidden, expert_ffn=args.expert_ffn, seed=args.seed,
    )  # fmt: skip
    print(f"wrote {args.out}")
    return EXIT_OK


def cmd_monitor(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.monitor import Monitor

    mon = Monitor(settings)
    for spec in args.model or []:
        model, _, path = spec.partition("=")
        if not path:
            raise ConfigError(f"--model wants ID=PATH, got {spec!r}")
        mon.register(model, path, args.source)
    _stop_on_signals(mon.stop)
    mon.run()
    return EXIT_OK


def cmd_coordinator(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.coordinator import Coordinator

    coord = Coordinator(settings, _node_id(args.id, "coord"), args.model_id, args.model)
    _stop_on_signals(coord.stop)
    coord.run()
    return EXIT_OK


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.worker import Worker

    worker = Worker(settings, _node_id(args.id, "worker"))
    _stop_on_signals(worker.stop)
    worker.run()
    return EXIT_OK


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from kvq import client
    from kvq.bus import connect
    from kvq.keys import Keys

    r, keys = connect(settings), Keys(settings.prefix)
    rid = client.send(r, keys, args.model, prompt=args.prompt, max_tokens=args.max_tokens)
    ids: list[int] = []
    text = ""
    for ev in client.events(r, keys, rid, timeout_s=args.timeout):
        if ev.kind == "token" and ev.token_id is not None:
            ids.append(ev.token_id)
            if not args.json:
                print(ev.text, end="", flush=True)
        elif ev.kind == "done":
            text = ev.text
    print(json.dumps({"request_id": rid, "token_ids": ids, "text": text}) if args.json else "")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.demo import DemoOptions, run_demo

    opts = DemoOptions(
        redis_url=args.redis, model_path=args.model, workers=args.workers,
        requests=args.requests, max_tokens=args.max_tokens, log_dir=args.log_dir,
    )  # fmt: skip

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
    from kvq.bench.bus import run_bus_bench

    result = run_bus_bench(settings, jobs=args.jobs, redis_url=args.redis)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("kvq", "raw", "rq"):
            r = result[name]
            print(f"{name:<4} {r['jobs_per_s']:>10.0f} jobs/s  p50 {r['p50_ms']:.3f} ms  "
                  f"p99 {r['p99_ms']:.3f} ms")  # fmt: skip
        print(f"ratio_vs_raw_batched {result['ratio_vs_raw_batched']:.2f}  "
              f"ratio_vs_rq {result['ratio_vs_rq']:.1f}")  # fmt: skip
    return EXIT_OK


def cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.server import EmbeddedRedis

    stop = threading.Event()
    _stop_on_signals(stop)
    with EmbeddedRedis(port=args.port, data_dir=args.dir, persist=args.dir is not None) as srv:
        print(srv.url, flush=True)
        stop.wait()
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="show or check the effective settings")
    c.add_argument("action", choices=["show", "check"])
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_config)

    m = sub.add_parser("model", help="model tools")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    mt = msub.add_parser("make-tiny", help="write a small synthetic MoE model as GGUF")
    mt.add_argument("out")
    for name, default in (("layers", 2), ("experts", 8), ("experts-used", 2), ("hidden", 64),
                          ("expert-ffn", 64), ("seed", 0)):  # fmt: skip
        mt.add_argument(f"--{name}", type=int, default=default)
    mt.set_defaults(fn=cmd_model)

    mon = sub.add_parser("monitor", help="run the control plane")
    mon.add_argument("--model", action="append", metavar="ID=PATH", help="register a model")
    mon.add_argument("--source", help="URL workers download the model from (default: PATH)")
    mon.set_defaults(fn=cmd_monitor)

    co = sub.add_parser("coordinator", help="run a coordinator for one model")
    co.add_argument("--model", required=True, help="GGUF file")
    co.add_argument("--model-id", required=True, help="registered model id")
    co.add_argument("--id", help="coordinator id (default coord-HOSTNAME)")
    co.set_defaults(fn=cmd_coordinator)

    w = sub.add_parser("worker", help="run a worker (outbound connections only)")
    w.add_argument("--id", help="worker id (default worker-HOSTNAME)")
    w.set_defaults(fn=cmd_worker)

    s = sub.add_parser("submit", help="send a prompt and stream the completion")
    s.add_argument("--model", required=True)
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_submit)

    d = sub.add_parser("demo", help="run everything on this machine and summarise")
    d.add_argument("--redis", help="Redis URL (default: start an embedded server)")
    d.add_argument("--model", help="GGUF file (default: make a tiny one)")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--requests", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=24)
    d.add_argument("--log-dir", help="write each process's log here")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bb = bsub.add_parser("bus", help="expert job round trips: kvq vs raw redis-py vs RQ")
    bb.add_argument("--jobs", type=int, default=2000)
    bb.add_argument("--redis", help="Redis URL (default: start an embedded server)")
    bb.add_argument("--json", action="store_true")
    bb.set_defaults(fn=cmd_bench)

    sv = sub.add_parser("server", help="run an embedded Redis server in the foreground")
    sv.add_argument("--port", type=int, default=6379)
    sv.add_argument("--dir", help="data directory (persists across restarts)")
    sv.set_defaults(fn=cmd_server)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("gguf").setLevel(logging.WARNING)
    fn: Callable[[argparse.Namespace, Settings], int] = args.fn
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"kvq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return fn(args, settings)
    except ConfigError as exc:
        print(f"kvq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvqError as exc:
        print(f"kvq: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except TimeoutError as exc:
        print(f"kvq: timed out: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("kvq: interrupted", file=sys.stderr)
        return 130
