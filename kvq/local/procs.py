"""Start and stop kvq child processes (the demo and the end-to-end tests use this)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvq.errors import ChildDied
from kvq.local.server import _die_with_parent


def _pinned(cpus: set[int]) -> Callable[[], None]:
    def preexec() -> None:  # in the child between fork and exec
        _die_with_parent()
        os.sched_setaffinity(0, cpus)

    return preexec


@dataclass
class Children:
    """Child `python -m kvq ...` processes, all stopped by `stop_all()`."""

    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: str | None = None

    def spawn(
        self,
        name: str,
        *args: str,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`python -m kvq *args` as `name`; `cpus`: pinned to those CPUs from its start (every
        thread it makes inherits them); `env`: instead of the shared environment."""
        out: int | object = subprocess.DEVNULL
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(f"{self.log_dir}/{name}.log", "wb")  # closed with the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvq", *args],
            env=self.env if env is None else env,
            stdout=out,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if cpus is None else _pinned(cpus),
        )
        if self.log_dir and hasattr(out, "close"):
            out.close()  # the child holds its own descriptor
        self.procs[name] = proc
        return proc

    def wait_for(
        self, cond: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1
    ) -> None:
        """Until `cond()` is true; ChildDied at once if a child exits, TimeoutError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                raise ChildDied(f"{', '.join(dead)} exited while waiting for {what}; see its log")
            if cond():
                return
            time.sleep(poll_s)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")

    def dead(self) -> list[str]:
        """Names of children that exited on their own."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGKILL)
        p.wait(5)

    def stop_all(self, timeout_s: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
