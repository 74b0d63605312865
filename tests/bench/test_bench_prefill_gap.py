"""`kvq bench prefill-gap` on a tiny model: the arms' windows and gaps are what chunked
prefill makes them (steps, not timings: those are the bench's to report)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.prefill_gap import PrefillGapBench, run_prefill_gap_bench
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pg") / "m.gguf"
    make_tiny(path, seed=2)
    return path


def test_the_arms_windows(model: Path) -> None:
    cfg = PrefillGapBench(str(model), streams=3, prompt_tokens=100, chunk=16)
    r = run_prefill_gap_bench(cfg)
    chunked, whole, alone = (r["arms"][k] for k in ("chunked", "whole", "alone"))
    assert chunked["steps"] == math.ceil(100 / 16), "one chunk a step, the first token last"
    assert whole["steps"] == 1 and alone["steps"] == chunked["steps"]
    assert chunked["gaps"] == 3 * chunked["steps"] and whole["gaps"] == 3
    assert alone["long_ttft_s"] is None and chunked["long_ttft_s"] > 0
    for a in (chunked, whole, alone):
        assert 0 < a["p50_gap_ms"] <= a["p99_gap_ms"] <= a["max_gap_ms"]


def test_a_prompt_longer_than_the_context_is_refused(model: Path) -> None:
    with pytest.raises(ConfigError, match="needs a context of"):
        run_prefill_gap_bench(PrefillGapBench(str(model), prompt_tokens=100_000))


def test_the_command_prints_json(model: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvq",
            "bench",
            "prefill-gap",
            "--model",
            str(model),
            "--streams",
            "2",
            "--prompt-tokens",
            "40",
            "--chunk",
            "8",
            "--json",
        ],
        capture_output=True,
        check=True,
        timeout=120,
        text=True,
    )
    r = json.loads(out.stdout)
    assert r["config"]["chunk"] == 8 and r["arms"]["chunked"]["steps"] == 5
