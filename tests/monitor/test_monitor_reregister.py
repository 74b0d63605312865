"""Issue 29: the active monitor publishes again a registration Redis lost (real Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.config import Settings
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny


@pytest.mark.parametrize("lost", ["models", "model_meta", "model_slices", "all"])
def test_a_lost_registration_is_published_again(
    settings: Settings, tmp_path: Path, lost: str
) -> None:
    path = tmp_path / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    mon = Monitor.from_settings(settings)
    info = mon.register("tiny", path)
    r, keys = mon.board.r, Keys(settings.prefix)
    mon.tick()
    assert mon.reregistered == 0, "nothing lost, nothing published again"
    names = ["models", "model_meta", "model_slices"] if lost == "all" else [lost]
    for name in names:
        r.delete(keys.models() if name == "models" else getattr(keys, name)("tiny"))
    mon.tick()
    assert mon.reregistered == 1
    assert mon.board.models() == ["tiny"]
    again = mon.board.model_info("tiny")
    assert again is not None and again.slices == info.slices
    assert set(mon.board.slice_demand("tiny")) == set(info.slices), "targets seeded again"
    r.close()
