"""A worker runs every expert it holds once before it announces "serving" (issue 10, K4)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvq.bank import Bank, BankOptions
from kvq.model import Backbone
from kvq.tools.synth import make_tiny
from kvq.worker.loader import warm_up


def test_warm_up_computes_every_expert_of_every_layer_once(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8, quant="q4_0", hidden=256, expert_ffn=256)
    bb = Backbone.from_gguf(path)
    bank = Bank(bb.experts.values(), BankOptions(hot_bytes=0, numa_policy="off", dynamic=False))
    seen: list[tuple[int, list[int]]] = []
    real = bank.forward

    def spy(layer, x, ids, w, *a, **kw):  # type: ignore[no-untyped-def]
        out = real(layer, x, ids, w, *a, **kw)
        assert torch.isfinite(out).all() and out.abs().sum() > 0, "the experts really ran"
        seen.append((layer, sorted(ids.flatten().tolist())))
        return out

    bank.forward = spy  # type: ignore[method-assign]
    assert warm_up(bank, 256, torch.float32, torch.device("cpu")) >= 0
    assert seen == [(0, list(range(8))), (1, list(range(8)))]
