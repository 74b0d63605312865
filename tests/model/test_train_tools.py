"""The training tooling (`kvq.tools.train`): the torch net computes what kvq runs from its GGUF
export, the corpus split depends on file names only, and batches come from the seed alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.model import Backbone, SeqStep
from kvq.text import load_tokenizer
from kvq.tools.train import corpus as cp
from kvq.tools.train.export import write_gguf
from kvq.tools.train.loop import TrainConfig, batch_at
from kvq.tools.train.net import MoeLM, NetConfig

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 8


@pytest.fixture(scope="module")
def tokenizer() -> object:
    pytest.importorskip("tokenizers")
    return cp.train_tokenizer(TEXT, 320)


def test_the_export_runs_in_kvq_as_the_net_computes(tmp_path: Path, tokenizer: object) -> None:
    tokens, merges = cp.vocab_lists(tokenizer)
    cfg = NetConfig(len(tokens), 2, 64, 4, 2, 16, 8, 2, 64, context=128)
    net = MoeLM(cfg)
    net.init_weights(3)
    with torch.no_grad():  # a spread router and residual, so routing and norms matter
        for p in net.parameters():
            p.mul_(5.0) if p.dim() >= 2 else p.add_(torch.rand(p.shape) * 0.5)
    path = tmp_path / "net.gguf"
    write_gguf(path, net, tokens, merges, name="t", quant="f32")
    tok = load_tokenizer(path)
    ids = tok.encode(TEXT[1])
    assert ids[0] == tokens.index(cp.END)
    assert ids[1:] == tokenizer.encode(TEXT[1], add_special_tokens=False).ids  # type: ignore[attr-defined]
    with torch.no_grad():
        ref = net(torch.tensor([ids]))[0][0].double()  # [T, V]
    bb = Backbone.from_gguf(path)
    ours = bb.forward([SeqStep(ids, bb.new_cache(), verify=True)]).double()  # [T, V]
    assert (ours - ref).abs().max() < 1e-4 * ref.abs().max()


def test_the_split_depends_on_names_only(tmp_path: Path) -> None:
    names = [f"m{i}.py" for i in range(60)] + ["pkg/a.py", "test/t.py", "site-packages/x.py"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text("x = 1\n")
    c = cp.stdlib_corpus(tmp_path)
    assert not {"test/t.py", "site-packages/x.py"} & {*c.train, *c.held_out}
    assert list(c.train) == sorted(c.train) and len(c.train) + len(c.held_out) == 61
    assert c.held_out and c.held_out == cp.stdlib_corpus(tmp_path).held_out


def test_a_batch_is_its_step_s_whatever_came_before() -> None:
    stream = np.arange(1, 5000, dtype=np.uint16)
    cfg = TrainConfig(seed=7, steps=10, batch=3, seq=16, lr=1e-3)
    b = batch_at(stream, cfg, 4)
    assert torch.equal(b, batch_at(stream, cfg, 4)) and b.shape == (3, 17)
    assert (b[:, 0] == 0).all() and (b[:, 2:] - b[:, 1:-1] == 1).all()
    assert not torch.equal(b, batch_at(stream, cfg, 5))
