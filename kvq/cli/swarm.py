"""Swarm routing commands (issue 5): `kvq swarm-sim`, `kvq bench swarm`."""

from __future__ import annotations

from typing import Any

Subparsers = Any


def register(sub: Subparsers, bench: Subparsers) -> None:
    """Adds this area's commands (none yet)."""
