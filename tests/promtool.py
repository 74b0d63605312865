"""Where the tests find `promtool` (Prometheus' rule checker), or skip saying how to get it.

From PATH, or from `.tools/bin/promtool`, where `.ci/run` unpacks Debian's `prometheus` package
(`apt-get download prometheus && dpkg -x prometheus_*.deb DIR`, no root needed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOW = "install promtool: .ci/run does (apt-get download prometheus; dpkg -x into .tools/)"


def promtool() -> str:
    found = shutil.which("promtool") or str(ROOT / ".tools" / "bin" / "promtool")
    if not Path(found).is_file():
        pytest.skip(f"promtool not found on PATH or in .tools/bin; {HOW}")
    return found
