"""A remote job the coordinator waits for (or a trial it does not), and its measured latency."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvq.slices import SliceSpec


@dataclass
class Pending:
    spec: SliceSpec
    rows: torch.Tensor  # [R] rows of the layer's x that this job carries
    worker: str
    sent_at: float  # time.monotonic()
    sent_ms: float  # Redis's clock (`Board.now_ms`), to compare with the result entry's id
    ref: torch.Tensor | None = None  # a trial's or probe's local result: its answer's check
    # answers to the same rows from other workers, waiting for this job's to confirm one
    # (a backbone-only coordinator's quorum, `LayerCall.deliver`)
    answers: list[Answer] = field(default_factory=list)
    pairs: int = 0  # an expert job's result rows: its (row, expert) pairs inside the slice


@dataclass(frozen=True)
class Answer:
    """One worker's result for a job's rows, as it came (`dtype`: the path it computed in)."""

    worker: str
    y: torch.Tensor  # [P, H] (an expert job's terms) or [N, H] (a stage job's rows)
    dtype: str
    numerics: str = ""  # a stage answer's `wire.Result.numerics`: one label, the same bits


def latency_ms(p: Pending, eid: bytes) -> float:
    """Send-to-arrival time of a result. The result is read only after the local slices are
    computed, so the read time overstates a fast worker's round trip by that compute; the
    entry id holds the millisecond Redis stored it, which does not (`sent_ms` is on Redis's
    clock too, `kvq.bus.clock`). The smaller of the two non-negative values is used."""
    read = (time.monotonic() - p.sent_at) * 1000
    try:
        stored = int(eid.split(b"-", 1)[0]) - p.sent_ms
    except ValueError:
        return read
    return stored if 0 <= stored < read else read
