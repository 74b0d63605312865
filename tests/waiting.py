"""The one way a test waits: poll a condition until it holds, or fail saying what never came.

A fixed sleep stands in for a condition it does not check: too short on a loaded machine, too
long everywhere else. `wait_for` returns as soon as the condition holds (its truthy value, so a
test can wait for a thing and use it) and fails at the deadline with `what` in the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    cond: Callable[[], Any],
    timeout_s: float = 15.0,
    what: str = "condition",
    *,
    poll_s: float = 0.02,
    ignore: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> Any:
    """`cond()`'s first truthy value within `timeout_s`; AssertionError naming `what` after it.

    `ignore`: exceptions `cond` may raise while what it reads is not up yet (a server still
    starting), counted as "not yet"; the last one is chained to the timeout's error.
    """
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            got = cond()
        except ignore as exc:
            got, last = None, exc
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from last
        time.sleep(poll_s)
