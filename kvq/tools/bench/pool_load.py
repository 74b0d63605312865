"""A closed loop that counts failures instead of stopping on the first (`kvq bench pool`).

`sequences` threads each send one request at a time and read it to its end; a request that
ends in an error or a timeout is counted as failed and the thread sends the next one. Token
arrival times are kept, so a window's tokens and the longest gap between tokens can be read.
"""

from __future__ import annotations

import threading
import time

from kvq import client
from kvq.bus import connect
from kvq.config import Settings
from kvq.keys import Keys


class CountingLoad:
    """`sequences` clients of `model` until `stop()`; `ok`, `failed`, `errors`, `stamps`."""

    def __init__(self, s: Settings, model: str, sequences: int, max_tokens: int) -> None:
        self.s, self.model, self.max_tokens = s, model, max_tokens
        self.ok = 0
        self.failed = 0
        self.stuck = 0  # requests still waiting when `stop` gave up on them
        self.errors: list[str] = []
        self.stamps: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(sequences)
        ]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 300.0) -> None:
        """Send no more; wait up to `timeout_s` in all for the requests in flight to end (each
        is counted); those still waiting then are counted in `stuck`."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.stuck = sum(t.is_alive() for t in self._threads)

    def tokens_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(start <= t < end for t in self.stamps)

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest time without a token from any client in [start, end]."""
        with self._lock:
            ts = [start, *sorted(t for t in self.stamps if start <= t < end), end]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)

    def _loop(self, n: int) -> None:
        r = connect(self.s.bus)
        keys = Keys(self.s.prefix)
        k = 0
        try:
            while not self._stop.is_set():
                prompt = f"Request {n}.{k}: the quick brown fox"
                k += 1
                try:
                    rid = client.send(
                        r, keys, self.model, prompt=prompt, max_tokens=self.max_tokens
                    )
                    for ev in client.events(r, keys, rid, timeout_s=300):
                        if ev.kind == "token":
                            with self._lock:
                                self.stamps.append(time.monotonic())
                except Exception as exc:  # noqa: BLE001 - counted: the bench reports failures
                    with self._lock:
                        self.failed += 1
                        self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with self._lock:
                    self.ok += 1
        finally:
            r.close()
