"""A coordinator started with another GGUF than the one registered for its model id refuses
to run (issue 12 item 9): size, metadata hash and one expert range are checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvq.catalog import ModelInfo
from kvq.config import Settings, child_env
from kvq.errors import ModelMismatch
from kvq.gguf.registry import check_model_file, plan_model
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("check")
    out = {name: d / f"{name}.gguf" for name in ("right", "bigger", "reseeded", "tampered")}
    make_tiny(out["right"], layers=2, experts=8, seed=3)
    make_tiny(out["bigger"], layers=3, experts=8, seed=3)
    make_tiny(out["reseeded"], layers=2, experts=8, seed=4)  # same size, other name/weights
    shutil.copy(out["right"], out["tampered"])
    return out


@pytest.fixture(scope="module")
def info(models: dict[str, Path]) -> ModelInfo:
    return plan_model("tiny", models["right"], 1, 4)


def test_the_registered_file_and_a_copy_pass(
    info: ModelInfo, models: dict[str, Path], tmp_path: Path
) -> None:
    assert len(info.header_sha256) == 64
    check_model_file(info, models["right"])
    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(models["right"], copy)
    check_model_file(info, copy)  # the path may differ, the bytes may not


def test_another_size_is_refused(info: ModelInfo, models: dict[str, Path]) -> None:
    with pytest.raises(
        ModelMismatch,
        match=r"bigger.gguf.*not the file registered as model "
        r"'tiny'.*bytes, registered \d+",
    ):
        check_model_file(info, models["bigger"])


def test_other_metadata_of_the_same_size_is_refused(
    info: ModelInfo, models: dict[str, Path]
) -> None:
    assert models["reseeded"].stat().st_size == models["right"].stat().st_size
    with pytest.raises(ModelMismatch, match="metadata sha256"):
        check_model_file(info, models["reseeded"])


def test_same_metadata_other_expert_bytes_is_refused(
    info: ModelInfo, models: dict[str, Path]
) -> None:
    first = min(info.slices.values(), key=lambda s: (s.layer_start, s.expert_start))
    with open(models["tampered"], "r+b") as f:
        f.seek(first.ranges[0].offset + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelMismatch, match="expert bytes of blk.0"):
        check_model_file(info, models["tampered"])


@pytest.mark.slow
def test_the_coordinator_process_refuses_a_wrong_file(
    settings: Settings, models: dict[str, Path]
) -> None:
    Monitor.from_settings(settings).register("tiny", models["right"])
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvq",
            "coordinator",
            "--model",
            str(models["reseeded"]),
            "--model-id",
            "tiny",
            "--id",
            "c-wrong",
        ],
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "kvq: ModelMismatch:" in out.stderr and "metadata sha256" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60
