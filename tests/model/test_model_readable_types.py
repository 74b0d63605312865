"""Types kvq cannot write but gguf can dequantize (here IQ4_NL) are served like the others:
through gguf's numpy reference instead of the fast torch path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvq.model import Backbone, expert_forward_reference
from kvq.model.generate import generate
from kvq.tools.synth import make_tiny


def _as_iq4_nl(path: Path) -> None:
    """Relabel the Q4_0 expert tensors IQ4_NL (same 18 bytes per 32 values) in place."""
    reader = GGUFReader(path, "r+")
    for t in reader.tensors:
        if "_exps" in t.name:
            assert t.tensor_type == GGMLQuantizationType.Q4_0
            t.field.parts[-2][0] = int(GGMLQuantizationType.IQ4_NL)
    del reader


def test_iq4_nl_experts_compute_like_their_reference(tmp_path: Path) -> None:
    path = tmp_path / "iq4nl.gguf"
    make_tiny(path, quant="q4_0", hidden=64, expert_ffn=64)
    _as_iq4_nl(path)
    bb = Backbone.from_gguf(path)
    sl = bb.experts[0]
    assert sl.gate.qtype == GGMLQuantizationType.IQ4_NL  # type: ignore[union-attr]
    x = torch.randn(5, 64)
    ids = torch.randint(0, sl.n_experts, (5, 2))
    w = torch.softmax(torch.randn(5, 2), -1)
    dense = sl.dense_copy(torch.float64)
    ref = expert_forward_reference(dense.gate, dense.up, dense.down, 0, x, ids, w)
    got = bb.local_moe(0, x, ids, w).double().numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5  # float32 vs float64 rounding
    assert len(generate(bb, [1, 2, 3], 4, stop_at_eos=False)) == 4
