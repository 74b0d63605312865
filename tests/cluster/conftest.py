"""A real local Redis Cluster (3 masters, from the bundled server binary) for the whole
session, and settings pointing at it with a per-test prefix."""

from __future__ import annotations

import gc
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.cluster import EmbeddedCluster
from kvq.config import Settings, load_settings
from kvq.model import make_tiny

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # e2e_helpers


@pytest.fixture(scope="session")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(masters=3) as c:
        yield c


@pytest.fixture
def settings(cluster: EmbeddedCluster) -> Iterator[Settings]:
    yield load_settings(
        redis_url=cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=100,
        heartbeat_ttl_s=1.0, volunteer_poll_s=0.05, monitor_poll_s=0.1, dispatch_refresh_ms=50,
        slot_poll_s=0.02, saturation_enter_s=0.0, saturation_leave_s=0.0,
    )  # fmt: skip
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    return path
