"""End-to-end fixtures: a tiny model, and kvq roles running in threads or processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from kvq.model import make_tiny


class Runnable(Protocol):
    stop: threading.Event

    def run(self) -> None: ...


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    return path


@pytest.fixture
def run_in_thread() -> Iterator[Callable[[Runnable], threading.Thread]]:
    """Start `obj.run()` on a thread; every one is stopped and joined after the test."""
    started: list[tuple[Runnable, threading.Thread]] = []

    def start(obj: Runnable) -> threading.Thread:
        t = threading.Thread(target=obj.run, daemon=True)
        t.start()
        started.append((obj, t))
        return t

    yield start
    for obj, _ in started:
        obj.stop.set()
    for _, t in started:
        t.join(timeout=10)
