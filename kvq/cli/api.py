"""`kvq api` (the OpenAI-compatible gateway) and `kvq bench api`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

log = logging.getLogger("kvq.cli")
Subparsers = Any


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from kvq.api import create_app
    from kvq.asgi import config

    s = settings.api
    log.info(
        "OpenAI-compatible API on http://%s:%s/v1 (auth %s)", s.host, s.port,
        "on" if s.keys else "off",
    )  # fmt: skip
    # uvicorn stops on SIGINT/TERM, then raises the signal again for the handler found before
    # it: for SIGTERM that is this no-op, so a stopped gateway exits 0 like every role
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.Server(config(create_app(settings), s.host, s.port)).run()
    return EXIT_OK


def cmd_bench_api(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bench.api import ApiBenchOptions, run_api_bench

    opts = ApiBenchOptions(
        streams=args.streams, requests=args.requests, max_tokens=args.max_tokens,
        rounds=args.rounds, model_path=args.model, workers=args.workers,
    )  # fmt: skip
    result = run_api_bench(settings, opts)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("direct", "api"):
            r = result[name]
            print(f"{name:<7} ttft p50 {r['ttft_p50_ms']:8.1f} ms  {r['tokens_per_s']:8.1f} tok/s")
        print(f"ratio (api / direct tokens/s) {result['ratio']:.3f}")
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    """api, bench api."""
    a = sub.add_parser("api", help="run the OpenAI-compatible HTTP gateway (KVQ_API_*)")
    a.set_defaults(fn=cmd_api)

    b = bench.add_parser("api", help="time to first token and tokens/s: kvq api vs kvq.client")
    b.add_argument("--streams", type=int, default=8, help="concurrent streams")
    b.add_argument("--requests", type=int, default=32, help="requests per side")
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--rounds", type=int, default=2, help="rounds per side, alternating")
    b.add_argument("--model", help="GGUF file (default: make a tiny one)")
    b.add_argument("--workers", type=int, default=0, help="workers to start (0: local experts)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench_api)
