"""End-to-end fixtures: a tiny model, and kvq roles running in threads or processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from acl_helpers import RoleSettings, role_settings

from kvq.config import Settings
from kvq.security import acl
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    return path


@pytest.fixture
def as_role(settings: Settings, r: redis.Redis) -> Iterator[RoleSettings]:
    """`as_role(role, worker=None)`: the test's settings logged in as that role's least-privilege
    ACL user (`kvq.security.acl`), deleted after the test."""
    made: list[str] = []
    yield role_settings(settings, r, made)
    if made:
        acl.remove(r, made)
