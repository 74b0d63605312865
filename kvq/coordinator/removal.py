"""A coordinator's model removed under it (`kvq model rm --force`): the slot-poll thread sees
the model's removal mark; the serving loop then ends every request it holds with a
`ModelRemoved` error and stops, and on its way out deletes again the keys of the model it
writes, so that nothing it wrote in between (its place among the model's coordinators, a
request group made again, routed counters) outlives it (what its ACL user may delete). A registration of the model in the meantime (the mark
gone) is left alone."""

from __future__ import annotations

import logging
import threading

from kvq.bus.board import Board
from kvq.errors import ModelRemoved

log = logging.getLogger("kvq.coordinator")


class Removal:
    """Whether `model` was removed while coordinator `coord` serves it."""

    def __init__(self, board: Board, model: str, coord: str) -> None:
        self.board, self.model, self.coord = board, model, coord
        self._seen = threading.Event()

    def check(self) -> bool:
        """Read the removal mark (on the slot-poll thread); True once it was seen."""
        if not self._seen.is_set() and self.board.model_removed(self.model):
            self._seen.set()
        return self._seen.is_set()

    @property
    def seen(self) -> bool:
        return self._seen.is_set()

    def error(self) -> ModelRemoved:
        return ModelRemoved(
            f"model {self.model!r} was removed (kvq model rm --force) while coordinator "
            f"{self.coord} served it; register it again (kvq monitor --model "
            f"{self.model}=PATH), then start this coordinator again"
        )

    def clean(self, shards: int) -> None:
        """Delete again what this coordinator wrote of the model since it was removed (its
        `shards` request streams included)."""
        if self.seen:
            self.board.forget_removed_model(self.model, shards)
            log.info("left nothing of removed model %s behind", self.model)
