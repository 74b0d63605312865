"""The bank as the coordinator will use it: a Backbone's experts, generation through
`bank.forward` with `bank.step()` per engine step, the same tokens as without the bank."""

from __future__ import annotations

from pathlib import Path

import pytest
from bank_helpers import opts, per_expert

from kvq.bank import Bank
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.text import ByteTokenizer
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    path = tmp_path_factory.mktemp("bankmodel") / "tiny.gguf"
    make_tiny(Path(path), layers=2, experts=8, experts_used=2, hidden=32, expert_ffn=32)
    return Backbone.from_gguf(path)


@pytest.mark.parametrize("dynamic", [False, True])
def test_generation_is_unchanged_and_counted(backbone: Backbone, dynamic: bool) -> None:
    bank = Bank(
        backbone.experts.values(),
        opts(hot_bytes=4 * per_expert(backbone.experts[0]), dynamic=dynamic, dyn_steps=3),
    )
    prompt = ByteTokenizer.from_meta(backbone.meta).encode("hot and cold")
    want = generate(backbone, prompt, 12, stop_at_eos=False)

    def moe(layer, x, ids, w):  # type: ignore[no-untyped-def]
        if layer == 0:
            bank.step()  # one engine step per forward pass
        return bank.forward(layer, x, ids, w)

    assert generate(backbone, prompt, 12, moe=moe, stop_at_eos=False) == want
    s = bank.stats()
    assert s["updates"] == 4 and s["rates"].routed == (len(prompt) + 11) * 2 * 2
    hot, cold = bank.hit_rates()
    assert hot + cold == pytest.approx(1.0)
    assert (s["swaps"] > 0) == dynamic
