"""Incremental detokenization with stop strings, for one sequence.

Text is decoded incrementally the way text-generation-inference does it: the new tokens are
decoded together with a few tokens before them (a tokenizer may change a piece's first
character by context, e.g. SentencePiece's leading space) and released only when the result
does not end in U+FFFD (the token ended inside a multi-byte character), so each step decodes a
few tokens, not the whole sequence. Released text is handed out once it is final: any tail that
could still grow into a stop string is held back. At the end the whole sequence is decoded once. A stop string is matched on the decoded text, across token boundaries, and
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
        self.full = ""  # everything decoded and released so far
        self._prefix = self._read = 0  # ids[_prefix:_read] give context to the next piece

    def push(self, ids: list[int]) -> str:
        """The new final text after `ids` (all ids generated so far); sets `stopped` when a
        stop string appears (the text is cut before it)."""
        before = self.decode(ids[self._prefix : self._read])
        after = self.decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.full += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
        full = self.full
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
        """How many trailing characters could still start a stop string."""
        for k in range(min(self.longest - 1, len(full)), 0, -1):
            if any(s.startswith(full[-k:]) for s in self.stops):
                return k
        return 0

    def _hand_out(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""  # nothing new (or an earlier character was re-decoded: keep what was sent)
        new = upto[len(self.text) :]
        self.text = upto
        return new
