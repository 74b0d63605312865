"""Hot/cold bank commands (issue 4): `kvq balance ...`, `kvq bench bank`."""

from __future__ import annotations

from typing import Any

Subparsers = Any


def register(sub: Subparsers, bench: Subparsers) -> None:
    """Adds this area's commands (none yet)."""
