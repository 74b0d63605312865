"""Helpers shared by the CLI modules."""

from __future__ import annotations

import argparse
import signal
import socket
import threading
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop`, so a role finishes its current step and leaves cleanly."""

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def node_id(given: str | None, role: str) -> str:
    return given or f"{role}-{socket.gethostname()}"


# -- argument types: a bad value is an argparse error (exit 2, one line), never a traceback ----
REDIS_SCHEMES = ("redis", "rediss", "unix")


def redis_url(text: str) -> str:
    """A Redis URL as redis-py takes it (`redis://`, `rediss://`, `unix://`)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in REDIS_SCHEMES or not rest:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Redis URL: use redis://HOST:PORT, rediss://... or unix:///PATH"
        )
    return text


def number(lo: float, hi: float, kind: type = float, lo_open: bool = False) -> Any:
    """An argparse type: a `kind` in [lo, hi] ((lo, hi] with `lo_open`)."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"want a{'n integer' if kind is int else ' number'}, got {text!r}"
            ) from None
        if not (lo < v if lo_open else lo <= v) or not v <= hi or v != v:
            left = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"want a value in {left}{lo:g}, {hi:g}], got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


PORT = number(0, 65535, int)
COUNT = number(1, 1 << 31, int)
