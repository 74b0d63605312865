"""`kvq bench prefill-gap`: the token gaps of decoding streams while a long prompt arrives,
read whole or in chunks (`KVQ_PREFILL_CHUNK`; `kvq.tools.bench.prefill_gap`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

Subparsers = Any  # argparse._SubParsersAction (private)


def cmd_bench_prefill_gap(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.prefill_gap import PrefillGapBench, run_prefill_gap_bench

    cfg = PrefillGapBench(
        model=args.model,
        streams=args.streams,
        prompt_tokens=args.prompt_tokens,
        chunk=args.chunk or settings.prefill_chunk,
        threads=args.threads,
        seed=args.seed,
    )
    r = run_prefill_gap_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    print(
        f"{cfg.streams} streams decoding, a {cfg.prompt_tokens}-token prompt arrives "
        f"({r['threads']} threads, {r['cpu_capability']}):"
    )
    for arm, a in r["arms"].items():
        ttft = (
            "" if a["long_ttft_s"] is None else f", long prompt's first token {a['long_ttft_s']} s"
        )
        print(
            f"  {arm:>8}: gap p50 {a['p50_gap_ms']} ms, p99 {a['p99_gap_ms']} ms, "
            f"max {a['max_gap_ms']} ms over {a['steps']} steps{ttft}"
        )
    print(f"p99 against alone: whole {r['p99_ratio_whole']}x, chunked {r['p99_ratio_chunked']}x")
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    """bench prefill-gap."""
    p = bench.add_parser("prefill-gap", help="decode gaps while a long prompt arrives")
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--streams", type=int, default=8, help="sequences decoding")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="the long prompt's tokens")
    p.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="tokens per step of the chunked arm (default: KVQ_PREFILL_CHUNK)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="prompt token ids")
    p.add_argument("--json", action="store_true", help="print JSON (for machines)")
    p.set_defaults(fn=cmd_bench_prefill_gap)
