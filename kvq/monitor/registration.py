"""A model's lifecycle on the board: publish (first or again, with another file), remove.

The monitor (inline or as an RQ job, `kvq.monitor.coarse`) publishes; `kvq model rm` removes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvq.bus.board import Board
from kvq.catalog import ModelInfo
from kvq.errors import ModelInUse, UnknownModel

log = logging.getLogger("kvq.monitor")


def publish(board: Board, info: ModelInfo, base_replicas: int) -> list[str]:
    """Register `info`; on a re-registration, the holders of every slice whose bytes changed
    (another file, another cut) give it back, so that no worker serves the old file's bytes.
    The workers released."""
    old = board.model_info(info.model)
    board.register_model(info, base_replicas)
    log.info("registered %s: %d slices (%s grain)", info.model, len(info.slices), info.grain)
    if old is None:
        return []
    changed = {
        sid
        for sid, spec in old.slices.items()
        if (got := info.slices.get(sid)) is None or got.sha256 != spec.sha256
    }
    out = set()
    for w, sids in board.assignments(info.model).items():
        for sid in changed.intersection(sids):
            board.release(info.model, w, sid)
            out.add(w)
    if changed:
        log.info(
            "%s registered again: %d slice(s) changed, given back by %d worker(s)",
            info.model,
            len(changed),
            len(out),
        )
    return sorted(out)


@dataclass(frozen=True, slots=True)
class Removed:
    """What `remove` did: the model, the workers whose slices it released, the live
    coordinators it was served by (only with `force`)."""

    model: str
    workers: list[str]
    coordinators: list[str]


def remove(board: Board, model: str, force: bool = False) -> Removed:
    """Unregister `model` (`Board.unregister_model`); refused (ModelInUse) while a live
    coordinator serves it, unless `force`."""
    if model not in board.models() and board.model_info(model) is None:
        raise UnknownModel(
            f"model {model!r} is not registered (kvq model list shows those that are)"
        )
    live = [c.coord for c in board.coordinators(model) if c.alive]
    if live and not force:
        raise ModelInUse(
            f"model {model!r} is served by {len(live)} live coordinator(s) "
            f"({', '.join(live)}); stop them first, or pass --force (their requests fail)"
        )
    workers = board.unregister_model(model)
    log.info("removed %s: slices of %d worker(s) released", model, len(workers))
    return Removed(model, workers, live)
