"""`kvq cancel` and `kvq workers quarantine|release|drain`: an operator's hand on a request or a
worker (`kvq.bus.operator`; the dashboard's buttons call the same functions)."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
from typing import Any

from kvq.cli.common import EXIT_OK, number
from kvq.config import Settings
from kvq.errors import ConfigError
from kvq.keys import check_id

Subparsers = Any
log = logging.getLogger("kvq.operator")


def _worker_id(text: str) -> str:
    """An argparse type: a worker id as `kvq worker --id` takes it."""
    try:
        return check_id("worker id", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _by(args: argparse.Namespace) -> str:
    """Who acts: `--by`, else this login (logged and written into the verdict)."""
    return str(args.by or f"cli:{getpass.getuser()}")


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    from kvq import client
    from kvq.bus import connect
    from kvq.keys import Keys

    r = connect(settings.bus)
    try:
        client.cancel(r, Keys(settings.prefix), args.model, args.request_id)
    finally:
        r.close()
    log.warning("operator %s: cancelled request %s of %s", _by(args), args.request_id, args.model)
    out = {"cancelled": args.request_id, "model": args.model, "by": _by(args)}
    print(json.dumps(out) if args.json else f"cancelled request {args.request_id}")
    return EXIT_OK


def cmd_workers(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bus import operator
    from kvq.bus.redis_board import open_board

    board = open_board(settings.bus, settings.lifetimes)
    models = [args.model] if args.model else None
    by = _by(args)
    try:
        if args.workers_cmd == "quarantine":
            done = operator.quarantine(board, args.worker, by, models, args.for_s, args.ban)
        elif args.workers_cmd == "release":
            done = operator.release(board, args.worker, by, models)
        else:
            done = operator.drain(board, args.worker, by, models)
    finally:
        board.r.close()
    if args.json:
        print(json.dumps({"worker": args.worker, "action": args.workers_cmd, "models": done}))
    else:
        print(f"{args.workers_cmd}: worker {args.worker} in {', '.join(done) or 'no model'}")
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    """cancel; workers quarantine|release|drain."""
    c = sub.add_parser("cancel", help="cancel a request: its coordinator drops it")
    c.add_argument("model", help="the model the request was sent to")
    c.add_argument("request_id", help="the request id (kvq submit --json prints it)")
    c.set_defaults(fn=cmd_cancel, kernels=False)
    w = sub.add_parser("workers", help="quarantine, release or drain a worker by hand")
    ws = w.add_subparsers(dest="workers_cmd", required=True)
    q = ws.add_parser("quarantine", help="no work and no result used for --for-s (or --ban)")
    q.add_argument(
        "--for-s", type=number(0, 365 * 86400, lo_open=True), default=3600.0, help="how long (s)"
    )
    q.add_argument("--ban", action="store_true", help="for good (until released)")
    ws.add_parser("release", help="trusted again now: ends a quarantine, ban or drain")
    ws.add_parser("drain", help="no new jobs or slices; what it was sent it answers")
    for p in (c, *ws.choices.values()):
        if p is not c:
            p.add_argument("worker", type=_worker_id, help="the worker id")
            p.add_argument("--model", help="only this model (default: every model it is in)")
            p.set_defaults(fn=cmd_workers, kernels=False)
        p.add_argument("--by", help="who acts, for the log and the verdict (default: cli:$USER)")
        p.add_argument("--json", action="store_true", help="print JSON (for machines)")
