"""`kvq` command line: parsing and printing only; the work happens in library calls.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or invalid settings. Each area registers
its own subcommands (`core`, `model`, `bank`, `swarm`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

import redis

from kvq import logs
from kvq.cli import (
    acl,
    api,
    bank,
    core,
    deadletter,
    elastic,
    engine,
    health,
    model,
    operator,
    swarm,
)
from kvq.cli.common import EXIT_FAIL, EXIT_USAGE
from kvq.config import Settings, load_settings
from kvq.errors import ConfigError, KvqError
from kvq.security.redact import redacted_text


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2): the problem and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvq", description="kvq: MoE experts served over Redis streams")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"kvq {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmarks (--json for machines)")
    bench = b.add_subparsers(dest="bench_cmd", required=True)
    for area in (core, api, health, model, bank, swarm, elastic, engine, deadletter, operator, acl):
        area.register(sub, bench)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvq")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def configure_kernels(settings: Settings) -> None:
    """The process-wide kernel options from the settings (and CC, the C compiler)."""
    from kvq.quant import qdot

    cache = str(qdot.default_cache_dir(settings.state_dir))
    cc = os.environ.get("CC", "cc")
    invariant = settings.batch_invariant
    qdot.configure(qdot.KernelOptions(settings.activations, cc, cache, batch_invariant=invariant))


# OpenMP threads that finish a parallel region wait passively (sleep) instead of spinning:
# kvq's roles share cores with each other and with Redis (a coordinator and a worker on one
# machine, each with a thread per core), and spinning teams starve whoever holds the data
# they wait for. Measured with a coordinator and a worker on 2 cores: 4-6 tok/s spinning,
# 26 passive (docs/limits.md). Read by the OpenMP runtime when it loads, so before torch.
PASSIVE_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    for name, value in PASSIVE_OPENMP.items():
        os.environ.setdefault(name, value)  # yours wins: OMP_WAIT_POLICY=ACTIVE spins
    # Ctrl-C / SIGINT raises KeyboardInterrupt even when this process inherited SIGINT as
    # ignored (started with `&` from a script, or under nohup): `kvq submit` cancels its
    # request on it, `kvq demo` stops its children
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # SIGTERM before a role has installed its own stop (while it starts: waiting for Redis
        # or for its model) ends it cleanly too, with exit code 0 like a running role
        signal.signal(signal.SIGTERM, _terminated)
    args = build_parser().parse_args(argv)
    fn: Callable[[argparse.Namespace, Settings], int] = args.fn
    try:
        settings = load_settings()
    except ConfigError as exc:
        if args.command == "config" and args.json:  # `config check --json`: an answer too
            print(json.dumps({"valid": False, "error": str(exc)}))
        print(f"kvq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(args.verbose, settings.log_format)
    if getattr(args, "kernels", True):  # commands that do not compute never load torch
        configure_kernels(settings)
    try:
        return fn(args, settings)
    except ConfigError as exc:
        print(f"kvq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvqError as exc:
        print(f"kvq: {type(exc).__name__}: {redacted_text(str(exc))}", file=sys.stderr)
        return EXIT_FAIL
    except TimeoutError as exc:
        print(f"kvq: timed out: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except redis.RedisError as exc:  # e.g. NOPERM, or a TLS failure met after the start
        line = " ".join(redacted_text(str(exc)).split())
        print(f"kvq: redis: {type(exc).__name__}: {line}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("kvq: interrupted", file=sys.stderr)
        return 130


def entry(argv: Sequence[str] | None = None) -> NoReturn:
    """The `kvq` command (and `python -m kvq`): `main(argv)`, then out at once with its code.

    A role has stopped cleanly when `main` returns (its slices given back, its children and
    connections closed); the interpreter's own teardown after that (a collection over every
    module torch loaded) kept a SIGTERMed worker alive for seconds more, past the 5 s a
    supervisor such as `kvq demo` gives it. Streams are flushed first; nothing kvq runs
    registers an exit hook."""
    code = main(argv)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to flush to
            stream.flush()
    os._exit(code)
