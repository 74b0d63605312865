"""`kvq deadletter list|show|requeue|purge`: the dead-letter stream for operators."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvq.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from kvq.config import Settings

Subparsers = Any


def cmd_deadletter(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bus import connect
    from kvq.bus.deadletters import get_dead, list_dead, purge, requeue
    from kvq.keys import Keys

    r, keys = connect(settings.bus), Keys(settings.prefix)
    try:
        if args.dl_cmd == "list":
            letters = list_dead(r, keys, args.count, args.source)
            if args.json:
                print(json.dumps([d.describe() for d in letters]))
            for d in [] if args.json else letters:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.ts_ms / 1000))
                print(f"{d.id}  {when}  {d.source}  {d.reason}")
            return EXIT_OK
        if args.dl_cmd == "show":
            one = get_dead(r, keys, args.id)
            if one is None:
                print(f"kvq deadletter: no dead letter {args.id}", file=sys.stderr)
                return EXIT_FAIL
            print(json.dumps(one.describe(), indent=None if args.json else 2))
            return EXIT_OK
        ids = None if args.all else args.ids
        if not args.all and not args.ids:
            print(f"kvq deadletter {args.dl_cmd}: give dead-letter ids, or --all", file=sys.stderr)
            return EXIT_USAGE
        if args.dl_cmd == "requeue":
            chosen = ids if ids is not None else [d.id for d in list_dead(r, keys, 10**9)]
            done = requeue(r, keys, chosen, settings.stream_maxlen)
            out: Any = [{"id": a, "requeued_as": b} for a, b in done]
        else:
            out = {"purged": purge(r, keys, ids)}
        print(json.dumps(out) if args.json else out)
        return EXIT_OK
    finally:
        r.close()


def register(sub: Subparsers, bench: Subparsers) -> None:
    """deadletter list|show|requeue|purge."""
    d = sub.add_parser("deadletter", help="inspect, requeue or purge dead letters")
    dl = d.add_subparsers(dest="dl_cmd", required=True)
    ls = dl.add_parser("list", help="the newest dead letters, newest first")
    ls.add_argument("--count", type=int, default=20, help="how many to list")
    ls.add_argument("--source", help="only those from this stream")
    sh = dl.add_parser("show", help="one dead letter with its original fields")
    sh.add_argument("id", help="dead-letter entry id (from list)")
    rq = dl.add_parser("requeue", help="re-add to the source stream and delete the letter")
    pg = dl.add_parser("purge", help="delete dead letters")
    for p in (rq, pg):
        p.add_argument("ids", nargs="*", help="dead-letter entry ids")
        p.add_argument("--all", action="store_true", help="every dead letter")
    for p in (ls, sh, rq, pg):
        p.add_argument("--json", action="store_true", help="print JSON (for machines)")
        p.set_defaults(fn=cmd_deadletter, kernels=False)
