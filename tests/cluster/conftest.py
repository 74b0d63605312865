"""Cluster tests: each starts its own local Redis Cluster (`kvq.local.cluster.EmbeddedCluster`). The
end-to-end and fault tests also run on a 3-master cluster in `make test`'s second run
(`CLUSTER_TESTS=1`, tests/conftest.py)."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.tools.synth import make_tiny

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # e2e_helpers


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    return path


@pytest.fixture(autouse=True)
def _finalize_dropped_cluster_sockets() -> Iterator[None]:
    """redis-py's cluster clients drop some node connections (to killed nodes, of pipelines
    over several slots) without closing them; their ResourceWarning then surfaced in
    whichever later test collected garbage first (tests/coordinator/test_capacity.py's
    hypothesis run, also before issue 10's changes). Finalized at each cluster test's end."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
