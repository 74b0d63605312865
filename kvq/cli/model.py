"""Model commands: `kvq model make-tiny`."""

from __future__ import annotations

import argparse
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

Subparsers = Any


def cmd_model(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.model import make_tiny

    make_tiny(
        args.out, layers=args.layers, experts=args.experts, experts_used=args.experts_used,
        hidden=args.hidden, expert_ffn=args.expert_ffn, seed=args.seed,
    )  # fmt: skip
    print(f"wrote {args.out}")
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    m = sub.add_parser("model", help="model tools")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    mt = msub.add_parser("make-tiny", help="write a small synthetic MoE model as GGUF")
    mt.add_argument("out")
    for name, default in (("layers", 2), ("experts", 8), ("experts-used", 2), ("hidden", 64),
                          ("expert-ffn", 64), ("seed", 0)):  # fmt: skip
        mt.add_argument(f"--{name}", type=int, default=default)
    mt.set_defaults(fn=cmd_model)
