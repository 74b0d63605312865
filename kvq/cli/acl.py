"""`kvq acl`: print each role's least-privilege ACL rules, or create the users (`--apply`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

Subparsers = Any  # argparse's _SubParsersAction is private


def cmd_acl(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.keys import Keys
    from kvq.security import acl

    keys = Keys(args.prefix or settings.prefix)
    wanted = acl.users(keys, args.role or [], args.worker or [])
    if args.apply is None:
        if args.json:
            print(json.dumps([dataclasses.asdict(u) for u in wanted], indent=2))
        for u in [] if args.json else wanted:
            print(f"# {u.role}\n" + shlex.join(u.setuser()))
        return EXIT_OK
    made = _apply(args.apply, wanted, settings)
    secrets = {
        name: {
            "role": u.role,
            "password": made[name],
            "url": acl.user_url(args.apply, name, made[name]),
        }
        for u in wanted
        for name in [u.name]
    }
    path = Path(args.secrets)
    path.write_text(json.dumps(secrets, indent=2) + "\n")
    os.chmod(path, 0o600)
    from kvq.security.redact import redacted_url

    for name, s in secrets.items():
        print(f"created {name} ({s['role']}): {redacted_url(s['url'])}")
    print(f"passwords and URLs written to {path} (mode 600)")
    return EXIT_OK


def _apply(url: str, wanted: list[Any], settings: Settings) -> dict[str, str]:
    from kvq.bus import connect
    from kvq.security import acl

    r = connect(dataclasses.replace(settings.bus, redis_url=url))
    try:
        return acl.apply(r, wanted)
    finally:
        r.close()


def register(sub: Subparsers, bench: Subparsers) -> None:
    a = sub.add_parser(
        "acl", help="least-privilege ACL users per role: print the rules, or --apply them"
    )
    a.add_argument(
        "--role",
        action="append",
        choices=["monitor", "coordinator", "worker", "client", "api"],
        help="only this role (repeatable; default: every role)",
    )
    a.add_argument(
        "--worker",
        action="append",
        metavar="ID",
        help="a worker id to make a user for (repeatable)",
    )
    a.add_argument("--prefix", help="key prefix (default KVQ_PREFIX)")
    a.add_argument("--apply", metavar="URL", help="create the users on this server (an admin URL)")
    a.add_argument(
        "--secrets",
        default="kvq-acl.json",
        help="where --apply writes passwords and URLs (default kvq-acl.json)",
    )
    a.add_argument("--json", action="store_true", help="print the rules as JSON")
    a.set_defaults(fn=cmd_acl, kernels=False)
