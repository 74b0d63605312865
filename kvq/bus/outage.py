"""How a long-running role rides out a Redis that cannot serve it for a while.

Three kinds of failure end no role; each is waited out with backoff and logged once per
episode (when it starts, and when Redis serves again), not once per retry:

- **unreachable**: the server, a cluster node or the network is down (`is_connection_error`);
- **refusing writes**: the server answers but refuses to write, `MISCONF` (its RDB or AOF
  disk failed), `OOM` (`maxmemory` under `noeviction`), `READONLY` (a replica), `BUSY` (a
  script runs too long), `LOADING`, `NOREPLICAS`, `MASTERDOWN` (`refusal`): reads still work,
  and writing works again once the operator frees the cause;
- **refused a command**: any other error reply (`WRONGTYPE` from a key a peer replaced with
  another type, an entry too big): the peer's fault, or a bug; the role goes on, the next
  tick usually succeeds (the reads of peers' keys skip bad keys themselves, `kvq.bus.safe`).

What does end a role: the server refuses its credentials or its ACL user lacks a command
(`NOAUTH`, `WRONGPASS`, `NOPERM`: a deployment error the operator must fix, `kvq acl`) or its
TLS handshake fails.

Every long-running loop of a role (the coordinator's ticks, the worker's serving loop, the
monitor's polls and its market) is one `run_until_stopped`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from kvq.bus.connection import Backoff, is_connection_error, is_tls_error

# error codes of a server that refuses (writes) until its operator fixes the cause
REFUSAL_CODES = ("MISCONF", "OOM", "READONLY", "BUSY", "LOADING", "NOREPLICAS", "MASTERDOWN")
_LOG_EVERY_S = 60.0  # one warning per kind of failure per minute, even across short episodes


def refusal(exc: BaseException) -> str | None:
    """The code (`REFUSAL_CODES`) when `exc` is Redis refusing to write for now, else None.
    redis-py strips the code of some (`OutOfMemoryError`, `ReadOnlyError`,
    `BusyLoadingError`) and keeps it in the text of the others."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "OOM"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(exc, redis.exceptions.BusyLoadingError):
        return "LOADING"
    if isinstance(exc, redis.ResponseError):
        head = str(exc).split(" ", 1)[0]
        return head if head in REFUSAL_CODES else None
    return None


def is_fatal(exc: BaseException) -> bool:
    """Whether `exc` must end the role: bad credentials, a missing ACL permission, TLS."""
    if isinstance(exc, redis.AuthenticationError | redis.exceptions.NoPermissionError):
        return True
    if isinstance(exc, redis.exceptions.AuthorizationError):
        return True
    return is_tls_error(exc) and not is_connection_error(exc)


def kind_of(exc: BaseException) -> str:
    """`unreachable`, `refusing writes (CODE)` or `refused a command`."""
    if is_connection_error(exc):
        return "unreachable"
    code = refusal(exc)
    if code is not None:
        return f"refusing writes ({code})"
    return "refused a command"


class Outage:
    """The episodes of one role's loop: `failed(exc)` after a tick that Redis could not serve
    (raises `exc` again if it is fatal, else logs and waits), `ok()` after one it served."""

    def __init__(self, log: logging.Logger, cap_s: float, base_s: float = 0.1) -> None:
        self.log, self.backoff = log, Backoff(cap_s, base_s)
        self.kind: str | None = None  # of the episode under way; None: Redis serves
        self.since = 0.0
        self.episodes = 0  # failures that started an episode (for tests and counters)
        self._logged: dict[str, float] = {}  # kind -> when it was last logged as a warning
        self._loud = False  # the episode under way was logged: so is its end

    def failed(self, exc: redis.RedisError) -> float:
        """Log the start of an episode (once), wait; the seconds waited."""
        if is_fatal(exc):
            raise exc
        kind = kind_of(exc)
        now = time.monotonic()
        if kind != self.kind:
            if self.kind is None:
                self.since = now
            self.kind = kind
            self.episodes += 1
            self._loud = now - self._logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S
            if self._loud:
                self._logged[kind] = now
                self.log.warning(
                    "redis %s: %s; retrying until it serves again", kind, _one_line(exc)
                )
            else:
                self.log.debug("redis %s: %s", kind, _one_line(exc))
        else:
            self.log.debug("redis still %s: %s", kind, _one_line(exc))
        return self.backoff.wait()

    def ok(self) -> None:
        """Redis served a tick: an episode under way ends (logged with its length)."""
        if self.kind is not None and self._loud:
            self.log.warning(
                "redis serves again after %.1fs (%s)", time.monotonic() - self.since, self.kind
            )
        self.kind = None
        self.backoff.reset()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def run_until_stopped(
    stop: threading.Event,
    step: Callable[[], bool | None],
    outage: Outage,
    pause_s: float = 0.0,
    after_failure: Callable[[], None] | None = None,
) -> None:
    """Call `step` until `stop` is set or `step` returns False. A Redis error it raises is
    waited out by `outage` (backoff, logged once per episode; a fatal one is raised again),
    then `after_failure` runs (a role reads its pending entries again); no other Redis error
    ends the loop. After a step Redis served, wait `pause_s` (woken early by `stop`)."""
    while not stop.is_set():
        try:
            go_on = step()
            outage.ok()
        except redis.RedisError as exc:
            outage.failed(exc)
            if after_failure is not None:
                after_failure()
            continue
        if go_on is False:
            return
        if pause_s > 0:
            stop.wait(pause_s)
