"""What the stage chain (`kvq.coordinator.chain`) keeps per sequence, per step and per job in
flight: plain records, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvq.coordinator.pending import Answer
from kvq.model import SeqStep


@dataclass
class ChainSeq:
    """A sequence as the chain knows it: its key, the tokens its holders hold, its holders."""

    key: str
    fed: list[int] = field(default_factory=list)  # tokens at positions 0..len-1, committed
    holders: dict[str, str] = field(default_factory=dict)  # span sid -> worker
    witnesses: dict[str, str] = field(default_factory=dict)  # span sid -> its second holder
    drawn: set[str] = field(default_factory=set)  # spans whose witness draw is made
    # span sid -> the rows it was sent, per job, since position 0 (witnessed spans: the
    # referee's replay)
    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)


@dataclass(eq=False)
class Rows:
    """One step's rows of a sequence on their way through the chain."""

    seq: ChainSeq
    tokens: list[int]  # the step's new tokens
    x: torch.Tensor  # [n, H] the rows entering span `next`
    start: int  # the position of the first row, in every span (0 after a replay)
    cohort: int  # the pass: rows of one pass travel together, passes overlap (pipelining)
    next: int = 0  # the next span to run
    busy: bool = False  # in a job now


@dataclass(eq=False)
class Pass:
    """One forward of some sequences through the chain (`Chain.start`)."""

    steps: list[SeqStep]
    rows: list[Rows]


@dataclass(eq=False)
class Pair:
    """A witnessed group's two jobs: the same rows to the holder and to the witness."""

    rows: list[Rows]
    span: int
    inputs: list[torch.Tensor]  # each row group's rows as sent (the referee's last chunk)
    holder: str
    witness: str | None  # None once it failed: the holder's answer goes on unconfirmed
    answers: dict[str, Answer] = field(default_factory=dict)
    referee: str = ""  # a third holder replaying the rows, when the two disagree
    replays: dict[int, torch.Tensor] = field(default_factory=dict)  # its rows, per row group


@dataclass
class InFlight:
    """A stage job in flight: where it went, which rows, which spans."""

    worker: str
    rows: list[Rows]
    spans: list[int]
    sent_at: float  # time.monotonic()
    pair: Pair | None = None  # a witnessed group's
    replay: int = -1  # a referee's replay of the pair's row group of this index
