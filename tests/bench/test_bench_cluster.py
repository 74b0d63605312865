"""`kvq bench bus --cluster N` (issue 14): its pairs land on distinct masters and both runs
move jobs."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from kvq.local.cluster import SLOTS
from kvq.tools.bench.cluster import pair_tags, run_cluster_bench

pytestmark = pytest.mark.slow


def test_pair_tags_fall_in_each_master_s_slot_range() -> None:
    for n in (1, 2, 3, 5):
        tags = pair_tags(n)
        assert [min(key_slot(t.encode()) // (SLOTS // n), n - 1) for t in tags] == list(range(n))


def test_cluster_bench_spreads_pairs_and_moves_jobs() -> None:
    out = run_cluster_bench(masters=2, seconds=1.0)
    assert out["masters_used"] == 2
    assert out["single_jobs_per_s"] > 0 and out["cluster_jobs_per_s"] > 0
    assert out["ratio"] == pytest.approx(
        out["cluster_jobs_per_s"] / out["single_jobs_per_s"], abs=1e-3
    )
