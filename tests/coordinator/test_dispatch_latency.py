"""A result's latency is taken from its entry id when the coordinator read it late (it was
computing its own slices), so a fast worker is not charged for the coordinator's compute."""

from __future__ import annotations

import time

import torch

from kvq.coordinator.pending import Pending, latency_ms


def _pending(sent_ago_ms: float) -> Pending:
    now_ms = time.time() * 1000
    return Pending(
        None, torch.zeros(1), "w", time.monotonic() - sent_ago_ms / 1000, now_ms - sent_ago_ms
    )  # type: ignore[arg-type]


def test_a_result_stored_early_but_read_late_counts_from_its_id() -> None:
    p = _pending(sent_ago_ms=30.0)
    eid = f"{int(p.sent_ms + 3)}-0".encode()  # Redis stored it 3 ms after the send
    assert 2.0 <= latency_ms(p, eid) <= 4.0


def test_the_read_time_bounds_it_and_a_bad_id_falls_back() -> None:
    p = _pending(sent_ago_ms=10.0)
    later = f"{int(p.sent_ms + 500)}-0".encode()  # a clock ahead of ours: not believable
    assert 9.0 <= latency_ms(p, later) < 100.0
    behind = f"{int(p.sent_ms - 50)}-0".encode()  # a clock behind ours
    assert 9.0 <= latency_ms(p, behind) < 100.0
    assert 9.0 <= latency_ms(p, b"not-an-id") < 100.0
