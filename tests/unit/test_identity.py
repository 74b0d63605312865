"""Default worker ids: unique per machine (a random suffix) and stable (kept on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.keys import check_id
from kvq.security.identity import default_worker_id


def test_the_default_id_is_kept_and_reused(tmp_path: Path) -> None:
    first = default_worker_id(str(tmp_path), hostname="gpu-box.lan")
    assert first.startswith("gpu-box.lan-") and len(first) == len("gpu-box.lan-") + 6
    assert default_worker_id(str(tmp_path), hostname="renamed") == first
    assert (tmp_path / "worker-id").read_text().strip() == first


def test_two_state_dirs_on_one_machine_give_two_ids(tmp_path: Path) -> None:
    a = default_worker_id(str(tmp_path / "a"), hostname="same")
    b = default_worker_id(str(tmp_path / "b"), hostname="same")
    assert a != b


def test_a_host_name_with_other_characters_still_gives_a_safe_id(tmp_path: Path) -> None:
    got = default_worker_id(str(tmp_path), hostname="my laptop{w:x}*")
    assert check_id("id", got) == got


def test_a_tampered_id_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "worker-id").write_text("a*b\n")
    with pytest.raises(ConfigError, match="not allowed"):
        default_worker_id(str(tmp_path))
