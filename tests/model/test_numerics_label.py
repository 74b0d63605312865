"""What a stage answer's `numerics` label promises (`kvq.device.numerics`): processes with one
label give a layer span the same bits (whatever their thread count), and torch's own vector
width, which changes the bits, changes the label. Each run is its own process, since torch
reads `ATEN_CPU_CAPABILITY` once, at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.tools.synth import make_tiny

RUN_SPAN = """
import hashlib, json, sys
import torch
from kvq.device import dtype_name, numerics
from kvq.model import Backbone
bb = Backbone.from_gguf(sys.argv[1])
cache = bb.new_cache()
x = bb.embed_tokens([(7 * j) % 200 + 3 for j in range(29)])
with torch.inference_mode():
    y = bb.run_span(x, [cache], [29])
    Backbone.advance_caches([cache], [29])
    y1 = bb.run_span(bb.embed_tokens([5]), [cache], [1])
digest = hashlib.sha256(y.numpy().tobytes() + y1.numpy().tobytes()).hexdigest()
print(json.dumps({"label": numerics(dtype_name(bb.dtype, bb.device)), "bits": digest}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("numerics") / "olmoe.gguf"
    make_tiny(path, arch="olmoe", layers=2, hidden=256, expert_ffn=256, head_dim=64, quant="q4_k_m")
    return path


def _run(model: Path, capability: str | None, threads: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    env.update(OMP_NUM_THREADS=str(threads), **extra)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run(
        [sys.executable, "-c", RUN_SPAN, str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return dict(json.loads(out.stdout.splitlines()[-1]))


def test_one_label_gives_the_same_bits_whatever_the_threads(model: Path) -> None:
    one, two = _run(model, None, 1), _run(model, None, 2)
    assert one["label"] and one["label"] == two["label"]
    assert one["bits"] == two["bits"]


def test_torchs_vector_width_changes_the_label_with_the_bits(model: Path) -> None:
    native = _run(model, None, 1)
    if native["label"].endswith(" DEFAULT"):
        pytest.skip("torch runs its plain kernels here: no other width to force")
    plain = _run(model, "default", 1)
    assert plain["label"] == native["label"].rsplit(" ", 1)[0] + " DEFAULT"
    print(f"bits {'differ' if plain['bits'] != native['bits'] else 'agree'} across the widths")


def test_an_override_of_mkls_dispatch_changes_the_label(model: Path) -> None:
    """MKL picks its code by CPU unless told otherwise (`MKL_CBWR`): the float32 products'
    bits follow, so the label names the override."""
    native, pinned = _run(model, None, 1), _run(model, None, 1, MKL_CBWR="COMPATIBLE")
    assert pinned["label"] != native["label"] and "MKL_CBWR=COMPATIBLE" in pinned["label"]
