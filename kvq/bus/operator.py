"""What an operator does by hand to a worker or a request, one function each: the CLI (`kvq
workers`, `kvq cancel`, `kvq deadletter`) and the monitor's dashboard call these, nothing else.

A worker's verdict is the model's `quarantine` record (`records.Quarantine`) with `operator`
set: coordinators take an operator's verdict as said (`kvq.coordinator.trust.Trust.merge`),
a release included, and the market and routing read `drain` as "no new work".

| action     | what changes                                                                |
|------------|-----------------------------------------------------------------------------|
| quarantine | no work and no result used until `until_ms` (or ever, `ban`); the monitor   |
|            | takes its slices back at its next tick                                      |
| release    | trusted again now (its mismatch count kept: the next catch may ban it)      |
| drain      | no new jobs and no new slice; its queued jobs are answered and used; then   |
|            | the worker gives its slices back itself (`Membership`), or the monitor      |
|            | takes them (a worker that may not read verdicts); none again until released |
| cancel     | the request's coordinator drops it at its next step (`kvq.client.cancel`)   |
"""

from __future__ import annotations

import logging

from kvq.bus.board import Board
from kvq.bus.records import Quarantine

log = logging.getLogger("kvq.operator")

QUARANTINE_S = 3600.0  # an operator's quarantine without a duration


def models_of(board: Board, worker: str) -> list[str]:
    """The models in which `worker` holds a slice or has a verdict."""
    return [m for m in board.models() if board.held_by(m, worker) or worker in board.quarantined(m)]


def _decide(
    board: Board,
    worker: str,
    models: list[str] | None,
    by: str,
    what: str,
    until_ms: float,
    banned: bool = False,
    drain: bool = False,
) -> list[str]:
    """Record an operator's verdict on `worker` in `models` (None: every model it is in);
    returns the models changed."""
    if not by:
        raise ValueError("an operator's action needs who did it")
    chosen = models_of(board, worker) if models is None else models
    now = int(board.now_ms())
    for m in chosen:
        old = board.quarantined(m).get(worker)
        verdict = Quarantine(
            until_ms=int(until_ms),
            mismatches=old.mismatches if old else 0,
            banned=banned,
            reason=f"{what} by operator {by}",
            ts_ms=now,
            operator=by,
            drain=drain,
        )
        board.quarantine(m, worker, verdict)
    log.warning(
        "operator %s: %s worker %s in %s", by, what, worker, ", ".join(chosen) or "no model"
    )
    return chosen


def quarantine(
    board: Board,
    worker: str,
    by: str,
    models: list[str] | None = None,
    for_s: float = QUARANTINE_S,
    ban: bool = False,
) -> list[str]:
    """No work for `worker` and none of its results used, for `for_s` (or for good: `ban`)."""
    until = board.now_ms() + for_s * 1000
    return _decide(board, worker, models, by, "banned" if ban else "quarantined", until, ban)


def release(board: Board, worker: str, by: str, models: list[str] | None = None) -> list[str]:
    """Trust `worker` again now, ending a quarantine, a ban or a drain."""
    return _decide(board, worker, models, by, "released", board.now_ms())


def drain(board: Board, worker: str, by: str, models: list[str] | None = None) -> list[str]:
    """No new work or slice for `worker`; what it was sent it answers, and it is used."""
    return _decide(board, worker, models, by, "drained", 0, drain=True)
