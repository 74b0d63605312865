"""A closed loop of client threads whose number in use can change while it runs.

Thread `k` sends one request at a time (prompt, `max_tokens`) and waits for its last event
while `k < active`; otherwise it idles. Changing `active` therefore moves the coordinator's busy
slots up or down within one request's time (`kvq bench elastic` steps and jitters it).
"""

from __future__ import annotations

import threading
import time

import redis

from kvq import client
from kvq.bus import connect
from kvq.config import load_settings
from kvq.keys import Keys


class ClosedLoop:
    """Up to `threads` clients of `model`; `set_active(n)` chooses how many send."""

    def __init__(
        self, redis_url: str, prefix: str, model: str, threads: int, max_tokens: int
    ) -> None:
        self.url, self.keys, self.model = redis_url, Keys(prefix), model
        self.max_tokens = max_tokens
        self.active = 0
        self.tokens = 0
        self.errors: list[str] = []
        self._in_flight = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(threads)
        ]
        for t in self._threads:
            t.start()

    def set_active(self, n: int) -> None:
        self.active = max(0, min(n, len(self._threads)))

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop sending; waits for requests in flight to finish."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def idle(self) -> bool:
        """No thread has a request in flight (after `set_active(0)` the load is gone)."""
        with self._lock:
            return self._in_flight == 0

    def _loop(self, k: int) -> None:
        r = connect(load_settings(redis_url=self.url).bus)  # any mode: standalone or cluster
        n = 0
        try:
            while not self._stop.is_set():
                if k >= self.active:
                    time.sleep(0.05)
                    continue
                with self._lock:
                    self._in_flight += 1
                try:
                    self._one(r, f"Request {k}.{n}: the quick brown fox")
                finally:
                    with self._lock:
                        self._in_flight -= 1
                n += 1
        except Exception as exc:  # noqa: BLE001 - reported by the bench, never a silent stop
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            r.close()

    def _one(self, r: redis.Redis, prompt: str) -> None:
        rid = client.send(r, self.keys, self.model, prompt=prompt, max_tokens=self.max_tokens)
        for ev in client.events(r, self.keys, rid, timeout_s=600):
            if ev.kind == "token":
                with self._lock:
                    self.tokens += 1
