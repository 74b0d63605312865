"""Incremental detokenization with stop strings, for one sequence.

Text is decoded from all the generated ids at once (a token may end inside a multi-byte
character, so per-token decoding would be wrong), and handed out only once it is final: a
trailing U+FFFD (an unfinished character) and any tail that could still grow into a stop string
are held back. A stop string is matched on the decoded text, across token boundaries, and
never handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class StopText:
    """The final text of one sequence so far, and whether a stop string has been produced."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self.decode, self.stops = decode, [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything handed out
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """The new final text after `ids` (all ids generated so far); sets `stopped` when a
        stop string appears (the text is cut before it)."""
        full = self.decode(ids)
        if self.stops:
            # a new match must end in the new text: search from where it could start
            start = max(0, len(self.text) - self.longest)
            hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._hand_out(full[: min(hits)])
        end = len(full) - self._held(full)
        return self._hand_out(full[:end])

    def flush(self, ids: list[int]) -> str:
        """Everything not handed out yet (the sequence ended without a stop string)."""
        return self._hand_out(self.decode(ids))

    def _held(self, full: str) -> int:
        """How many trailing characters may still change or start a stop string."""
        n = 0
        while n < len(full) and full[len(full) - 1 - n] == REPLACEMENT:
            n += 1
        tail = full[: len(full) - n]
        for k in range(min(self.longest - 1, len(tail)), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return n + k
        return n

    def _hand_out(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""  # nothing new (or an earlier character was re-decoded: keep what was sent)
        new = upto[len(self.text) :]
        self.text = upto
        return new
