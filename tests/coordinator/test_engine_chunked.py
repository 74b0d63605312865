"""Chunked prefill: a prompt read over several engine steps gives the tokens that reading it
in one step gives, for every attention kind (sliding window, chunked, latent, recurrent), and
sequences that decode meanwhile get a token at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.coordinator.engine import Engine, Sequence
from kvq.model import Backbone, SeqStep
from kvq.model.generate import generate
from kvq.text import ByteTokenizer
from kvq.tools.synth import make_tiny

ARCHS = ["qwen3moe", "gpt-oss", "llama4", "deepseek2", "qwen35moe", "olmoe"]
PROMPT = list(range(3, 45))  # 42 tokens: past gpt-oss's window (8) and llama4's chunk


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    path = tmp_path_factory.mktemp("chunked") / f"{request.param}.gguf"
    make_tiny(path, arch=request.param, seed=7)
    return Backbone.from_gguf(path)


def _run(engine: Engine) -> dict[str, Sequence]:
    out: dict[str, Sequence] = {}
    while engine.busy:
        for seq in engine.step(None, lambda seqs: None):
            out[seq.request_id] = seq
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_a_prompt_read_in_chunks_gives_the_same_tokens(model: Backbone, chunk: int) -> None:
    want = generate(model, PROMPT, 8)
    engine = Engine(model, ByteTokenizer(), n_slots=1, prefill_chunk=chunk)
    engine.admit("r", PROMPT, 8, b"")
    assert _run(engine)["r"].generated == want


def test_the_last_chunks_logits_equal_one_steps(model: Backbone) -> None:
    """The logits after the last chunk equal those of reading the prompt whole (to float
    rounding: the matmuls see other row counts)."""
    whole, parts = model.new_cache(), model.new_cache()
    with torch.inference_mode():
        want = model.forward([SeqStep(PROMPT, whole)])[0]
        for i in range(0, len(PROMPT), 10):
            got = model.forward([SeqStep(PROMPT[i : i + 10], parts)])[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_decoders_get_a_token_every_step_and_the_budget_is_shared(tmp_path: Path) -> None:
    """8 prompt tokens a step over all prompts, first admitted first; the decoding
    sequences read their one token at every step, outside the budget."""
    make_tiny(tmp_path / "m.gguf", seed=3)
    bb = Backbone.from_gguf(tmp_path / "m.gguf")
    engine = Engine(bb, ByteTokenizer(), n_slots=4, prefill_chunk=8)
    engine.admit("a", [5, 6], 30, b"")
    engine.admit("b", [7, 8, 9], 30, b"")
    engine.step(None, lambda seqs: None)  # both short prompts fit one step's 8 tokens
    assert [len(s.generated) for s in engine.active] == [1, 1]
    long1, long2 = list(range(10, 30)), list(range(30, 42))  # 20 and 12 tokens
    engine.admit("c", long1, 4, b"")
    engine.admit("d", long2, 4, b"")
    rows: list[list[int]] = []
    forward = bb.forward

    def counting(steps: list[SeqStep], moe: object = None) -> torch.Tensor:
        rows.append([len(st.tokens) for st in steps])
        return forward(steps, moe=moe)  # type: ignore[arg-type]

    bb.forward = counting  # type: ignore[method-assign]
    firsts = []
    for _ in range(4):
        made = [len(s.generated) for s in engine.active]
        engine.step(None, lambda seqs: None)
        assert [len(s.generated) - m for s, m in zip(engine.active[:2], made[:2], strict=True)] == [
            1,
            1,
        ]
        firsts.append([len(s.generated) for s in engine.active[2:]])
    # c reads 8, 8, then its last 4; d's first piece (8: prompts are cut at multiples of the
    # budget from their start, X17) does not fit the 4 left and waits a step
    assert rows == [[1, 1, 8], [1, 1, 8], [1, 1, 4], [1, 1, 1, 8]]
    assert firsts == [[0, 0], [0, 0], [1, 0], [2, 0]]
    engine.step(None, lambda seqs: None)  # d's last 4
    c, d = engine.active[2], engine.active[3]
    assert c.generated == generate(bb, long1, 3, chunk=8)
    assert d.generated == generate(bb, long2, 1, chunk=8)
