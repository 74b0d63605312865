"""`kvq api` (the OpenAI-compatible gateway) and `kvq bench api`."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import threading
from typing import Any

from kvq.cli.common import COUNT, EXIT_OK, PORT, stop_on_signals
from kvq.config import Settings
from kvq.errors import ServerError

log = logging.getLogger("kvq.cli")
Subparsers = Any


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    import socket

    import uvicorn

    from kvq.api import create_app
    from kvq.asgi import config

    s = settings.api
    host = args.host or s.host
    port = s.port if args.port is None else args.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound here: a busy port is one line and exit 1, before any URL is logged
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    port = sock.getsockname()[1]
    app = create_app(settings)
    app.state.gateway.gate.check_counting()  # a per-key limit under a user that cannot count
    server = uvicorn.Server(config(app, host, port))
    stop = threading.Event()
    stop_on_signals(stop)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    threading.Thread(target=_stop_when, args=(stop, server), daemon=True).start()
    models = app.state.gateway.gate.models()
    log.info(
        "ready: OpenAI-compatible API on http://%s:%s/v1 for %s (auth %s)",
        host,
        port,
        ", ".join(models) if models else "the models a monitor registers",
        "on" if s.keys else "off",
    )
    server.run(sockets=[sock])  # SIGINT/TERM: finish the open calls, then exit 0
    return EXIT_OK


def _stop_when(stop: threading.Event, server: Any) -> None:
    stop.wait()
    server.should_exit = True


def cmd_bench_api(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.api import ApiBenchOptions, run_api_bench

    opts = ApiBenchOptions(
        streams=args.streams,
        requests=args.requests,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        model_path=args.model,
        workers=args.workers,
    )
    result = run_api_bench(settings, opts)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("direct", "api"):
            r = result[name]
            print(f"{name:<7} ttft p50 {r['ttft_p50_ms']:8.1f} ms  {r['tokens_per_s']:8.1f} tok/s")
        print(f"ratio (api / direct tokens/s) {result['ratio']:.3f}")
    return EXIT_OK


def cmd_bench_structured(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.structured import StructuredBench, run_structured_bench

    cfg = StructuredBench(
        model=args.model,
        schema=args.schema,
        sequences=args.sequences,
        tokens=args.tokens,
        rounds=args.rounds,
        threads=args.threads,
    )
    result = run_structured_bench(cfg)
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    for n, ratio in result["ratio"].items():
        plain, schema = result["plain"][n]["tok_s"], result["schema_side"][n]["tok_s"]
        print(
            f"{n:>3} sequences  plain {plain:8.1f} tok/s  schema {schema:8.1f} tok/s  "
            f"ratio {ratio:.3f}"
        )
    return EXIT_OK


def cmd_bench_speculative(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.speculative import SpeculativeBench, load_prompts, run_speculative_bench

    cfg = SpeculativeBench(
        model=args.model,
        sequences=args.sequences,
        tokens=args.tokens,
        rounds=args.rounds,
        threads=args.threads,
        draft_tokens=args.draft_tokens,
        prompts=load_prompts(args.prompts) if args.prompts else (),
    )
    result = run_speculative_bench(cfg)
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    for n, speedup in result["speedup"].items():
        plain, drafts = result["plain"][n], result["drafts"][n]
        print(
            f"{n:>3} sequences  plain {plain['tok_s']:8.1f} tok/s  drafts {drafts['tok_s']:8.1f} "
            f"tok/s  speedup {speedup:.3f}  acceptance {drafts['acceptance']:.3f}  "
            f"tokens/pass {drafts['tokens_per_pass']:.2f}"
        )
    print(f"same tokens: {result['same']}")
    return EXIT_OK


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts like 1,8") from None


def register(sub: Subparsers, bench: Subparsers) -> None:
    """api, bench api, bench structured, bench speculative."""
    a = sub.add_parser("api", help="run the OpenAI-compatible HTTP gateway (KVQ_API_*)")
    a.add_argument("--host", help="address to bind (default KVQ_API_HOST, 127.0.0.1)")
    a.add_argument("--port", type=PORT, help="port (default KVQ_API_PORT, 8000; 0 = any free)")
    a.set_defaults(fn=cmd_api, kernels=False)

    b = bench.add_parser("api", help="time to first token and tokens/s: kvq api vs kvq.client")
    b.add_argument("--streams", type=COUNT, default=8, help="concurrent streams")
    b.add_argument("--requests", type=COUNT, default=32, help="requests per side")
    b.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    b.add_argument("--rounds", type=int, default=2, help="rounds per side, alternating")
    b.add_argument("--model", help="GGUF file (default: make a tiny one)")
    b.add_argument("--workers", type=int, default=0, help="workers to start (0: local experts)")
    b.add_argument("--json", action="store_true", help="print JSON (for machines)")
    b.set_defaults(fn=cmd_bench_api)

    st = bench.add_parser("structured", help="tok/s with and without a JSON schema's mask")
    st.add_argument("--model", required=True, help="GGUF file")
    st.add_argument("--schema", help="JSON schema file (default: one no answer completes)")
    st.add_argument("--sequences", type=_counts, default=(1, 8), help="counts, e.g. 1,8")
    st.add_argument("--tokens", type=COUNT, default=32, help="tokens per sequence")
    st.add_argument("--rounds", type=COUNT, default=3, help="rounds per side, alternating")
    st.add_argument("--threads", type=COUNT, default=2, help="torch threads")
    st.add_argument("--json", action="store_true", help="print JSON (for machines)")
    st.set_defaults(fn=cmd_bench_structured)

    sp = bench.add_parser("speculative", help="tok/s with and without n-gram drafts (X13)")
    sp.add_argument("--model", required=True, help="GGUF file")
    sp.add_argument("--sequences", type=_counts, default=(1, 8), help="counts, e.g. 1,8")
    sp.add_argument("--tokens", type=COUNT, default=64, help="tokens per sequence")
    sp.add_argument("--rounds", type=COUNT, default=3, help="rounds per side, alternating")
    sp.add_argument("--threads", type=COUNT, default=2, help="torch threads")
    sp.add_argument("--draft-tokens", type=COUNT, default=4, help="the longest draft")
    sp.add_argument("--prompts", help="JSON file: a list of prompts (sequence i reads i mod n)")
    sp.add_argument("--json", action="store_true", help="print JSON (for machines)")
    sp.set_defaults(fn=cmd_bench_speculative)
