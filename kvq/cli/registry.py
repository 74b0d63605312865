"""Model lifecycle commands: `kvq model list`, `kvq model rm`, `kvq model pull`."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

if TYPE_CHECKING:
    from kvq.bus.redis_board import RedisBoard

Subparsers = Any  # argparse's _SubParsersAction is private


def _board(settings: Settings) -> RedisBoard:
    from kvq.bus.redis_board import open_board

    return open_board(settings.bus, settings.lifetimes)


def model_rows(board: RedisBoard) -> list[dict[str, Any]]:
    """One row per registered model: its source, shape, slices covered, holders, coordinators."""
    rows = []
    for model in board.models():
        info = board.model_info(model)
        if info is None:
            continue
        demand = board.slice_demand(model)
        views = board.workers(model)
        rows.append(
            {
                "model": model,
                "source": info.source,
                "arch": info.meta.arch,
                "grain": info.grain,
                "slices": len(info.slices),
                "covered": sum(1 for d in demand.values() if d.coverage > 0),
                "workers": len({v.worker_id for v in views if v.alive}),
                "coordinators": sum(1 for c in board.coordinators(model) if c.alive),
                "file_bytes": info.meta.file_size,
            }
        )
    return rows


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = model_rows(_board(settings))
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    if not rows:
        print(f"no model registered under prefix {settings.prefix!r}")
        return EXIT_OK
    print(
        f"{'model':<24} {'arch':<10} {'slices':>8} {'covered':>8} {'workers':>8} {'coord':>6}  source"
    )
    for r in rows:
        print(
            f"{r['model']:<24} {r['arch']:<10} {r['slices']:>8} {r['covered']:>8} "
            f"{r['workers']:>8} {r['coordinators']:>6}  {r['source']}"
        )
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.monitor.registration import remove

    got = remove(_board(settings), args.id, force=args.force)
    if args.json:
        print(
            json.dumps(
                {"model": got.model, "workers": got.workers, "coordinators": got.coordinators}
            )
        )
        return EXIT_OK
    print(
        f"removed {got.model}: its keys deleted, slices released from {len(got.workers)} "
        f"worker(s)"
        + (
            f"; {len(got.coordinators)} live coordinator(s) lose it (--force)"
            if got.coordinators
            else ""
        )
    )
    return EXIT_OK


def cmd_pull(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.gguf.remote import check_source, pull, pull_target

    check_source(args.url, "kvq model pull URL")
    out = args.out or pull_target(args.url)[2]
    got = pull(args.url, out, args.sha256, timeout_s=args.timeout_s)
    if args.json:
        print(
            json.dumps(
                {
                    "path": got.path,
                    "bytes": got.nbytes,
                    "sha256": got.sha256,
                    "resumed_from": got.resumed_from,
                }
            )
        )
        return EXIT_OK
    resumed = f", resumed at {got.resumed_from:,}" if got.resumed_from else ""
    checked = " (matches --sha256)" if args.sha256 else ""
    print(f"wrote {got.path}: {got.nbytes:,} bytes{resumed}; sha256 {got.sha256}{checked}")
    return EXIT_OK


def _sha256(text: str) -> str:
    if len(text) != 64 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise argparse.ArgumentTypeError(f"--sha256 wants 64 hex digits, got {text!r}")
    return text.lower()


def add(msub: Subparsers) -> None:
    """model list, model rm, model pull (under `kvq model`)."""
    ml = msub.add_parser("list", help="the registered models, their coverage and holders")
    ml.add_argument("--json", action="store_true", help="print JSON (for machines)")
    ml.set_defaults(fn=cmd_list, kernels=False)
    mr = msub.add_parser("rm", help="unregister a model: slices released, its keys deleted")
    mr.add_argument("id", help="the model id")
    mr.add_argument(
        "--force", action="store_true", help="remove it even while live coordinators serve it"
    )
    mr.add_argument("--json", action="store_true", help="print JSON (for machines)")
    mr.set_defaults(fn=cmd_rm, kernels=False)
    mp = msub.add_parser("pull", help="download a GGUF over http(s), resumable, checksummed")
    mp.add_argument("url", help="http(s):// URL of the GGUF file")
    mp.add_argument("--out", help="file to write (default: the URL's file name, here)")
    mp.add_argument("--sha256", type=_sha256, help="expected sha256 (64 hex digits)")
    mp.add_argument("--timeout-s", type=float, default=30.0, help="per read, seconds")
    mp.add_argument("--json", action="store_true", help="print JSON (for machines)")
    mp.set_defaults(fn=cmd_pull, kernels=False)
