"""Helpers shared by the CLI modules."""

from __future__ import annotations

import signal
import socket
import threading

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop`, so a role finishes its current step and leaves cleanly."""

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def node_id(given: str | None, role: str) -> str:
    return given or f"{role}-{socket.gethostname()}"
