"""Micro-batched forward (issue 10 item 7): what it computes, and in what order.

The exact equality that holds: each micro-batch's logits are bit-identical to a forward over
its sequences alone. Against one forward over all sequences the logits agree to float32
rounding only (kvq's kernels sum in a different order for a different number of rows), and
greedy tokens agree on these models.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvq.coordinator.drafts import DraftPlan
from kvq.coordinator.engine import Engine
from kvq.model import Backbone, SeqStep
from kvq.model.microbatch import SplitMoe, forward_microbatched, split_rows
from kvq.text import ByteTokenizer
from kvq.tools.synth import make_tiny

PROMPTS = [[5, 9, 2], [7], [11, 3, 3, 8, 1], [4, 4], [6, 1, 9], [13, 2, 7, 7]]


class Recording:
    """A SplitMoe over the backbone's local experts that logs starts and finishes."""

    def __init__(self, bb: Backbone, microbatches: int) -> None:
        self.bb, self.microbatches = bb, microbatches
        self.log: list[tuple[str, int, int]] = []  # (start|finish, layer, rows)

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        return self.start(layer, x, ids, w)()

    def start(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        self.log.append(("start", layer, x.shape[0]))

        def finish() -> torch.Tensor:
            self.log.append(("finish", layer, x.shape[0]))
            return self.bb.local_moe(layer, x, ids, w)

        return finish


@pytest.fixture(scope="module")
def q4k(tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    """Fused Q4_K kernels: the path where row counts change float rounding."""
    path: Path = tmp_path_factory.mktemp("q4k") / "q4k.gguf"
    make_tiny(path, quant="q4_k", hidden=256, expert_ffn=256, layers=3)
    return Backbone.from_gguf(path)


def test_split_rows_balances_and_keeps_order() -> None:
    assert split_rows([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]
    assert split_rows([20, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_rows([3], 2) == [[0]]
    assert split_rows([1, 2, 3], 1) == [[0, 1, 2]]
    groups = split_rows([5, 1, 4, 2, 3, 1], 3)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(g == sorted(g) for g in groups)


def test_recording_is_a_split_moe(backbone: Backbone) -> None:
    assert isinstance(Recording(backbone, 2), SplitMoe)


@pytest.mark.parametrize("which", ["backbone", "q4k", "qwen2_backbone"])
def test_each_microbatch_equals_its_own_forward_bit_for_bit(
    which: str, request: pytest.FixtureRequest
) -> None:
    bb: Backbone = request.getfixturevalue(which)
    groups = [[0, 2, 4], [1, 3, 5]]
    caches = [bb.new_cache() for _ in PROMPTS]
    alone = [bb.new_cache() for _ in PROMPTS]
    nxt = [list(p) for p in PROMPTS]
    for _ in range(4):  # a prefill, then decode steps
        outs = forward_microbatched(
            bb,
            [[SeqStep(nxt[i], caches[i]) for i in g] for g in groups],
            Recording(bb, 2).start,
        )
        refs = [bb.forward([SeqStep(nxt[i], alone[i]) for i in g]) for g in groups]
        for out, ref in zip(outs, refs, strict=True):
            assert torch.equal(out, ref)
        tokens = {
            i: int(t)
            for g, o in zip(groups, outs, strict=True)
            for i, t in zip(g, o.argmax(-1), strict=True)
        }
        nxt = [[tokens[i]] for i in range(len(PROMPTS))]
    assert [c.length for c in caches] == [c.length for c in alone]


def test_interleaves_attention_with_the_other_microbatch_in_flight(backbone: Backbone) -> None:
    moe = Recording(backbone, 2)
    steps = [SeqStep(list(p), backbone.new_cache()) for p in PROMPTS[:4]]
    forward_microbatched(backbone, [steps[:2], steps[2:]], moe.start)
    kinds = [(k, layer) for k, layer, _ in moe.log]
    # A starts layer 0, B starts layer 0 (its attention ran while A was in flight), then A
    # finishes layer 0 and starts layer 1 before B finishes layer 0
    assert kinds[:5] == [("start", 0), ("start", 0), ("finish", 0), ("start", 1), ("finish", 0)]
    assert len(moe.log) == 2 * 2 * backbone.meta.block_count


def test_caches_do_not_advance_when_a_pass_fails(backbone: Backbone) -> None:
    steps = [SeqStep(list(p), backbone.new_cache()) for p in PROMPTS[:2]]

    def broken(
        layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        return lambda: torch.zeros(1, 1)  # the wrong shape

    with pytest.raises(Exception, match="moe fn returned shape"):
        forward_microbatched(backbone, [steps[:1], steps[1:]], broken)
    assert [s.cache.length for s in steps] == [0, 0]


@pytest.mark.parametrize("which", ["backbone", "q4k"])
def test_engine_greedy_tokens_equal_single_batch(
    which: str, request: pytest.FixtureRequest
) -> None:
    bb: Backbone = request.getfixturevalue(which)
    runs = {}
    for mb in (1, 2, 3):
        eng = Engine(bb, ByteTokenizer(), n_slots=len(PROMPTS))
        seqs = [eng.admit(f"r{i}", p, 8, b"") for i, p in enumerate(PROMPTS)]
        moe = Recording(bb, mb)
        while eng.active:
            eng.step(moe, lambda _: None)
        runs[mb] = [s.generated for s in seqs]
        if mb > 1:  # it really ran micro-batches: more MoE calls than layers x steps
            assert len(moe.log) > 2 * bb.meta.block_count * 8
    assert runs[2] == runs[1] and runs[3] == runs[1]


def _served(bb: Backbone, microbatches: int, drafts: DraftPlan | None) -> tuple[list, int]:  # type: ignore[type-arg]
    eng = Engine(bb, ByteTokenizer(), n_slots=len(PROMPTS), drafts=drafts)
    seqs = [eng.admit(f"r{i}", p * 3, 8, b"") for i, p in enumerate(PROMPTS)]  # p * 3: repeats
    moe = Recording(bb, microbatches)
    while eng.active:
        eng.step(moe, lambda _: None)
    return [s.generated for s in seqs], eng.spec.drafted


@pytest.mark.parametrize("which", ["backbone", "q4k"])
def test_engine_drafts_in_micro_batches_give_plain_tokens(
    which: str, request: pytest.FixtureRequest
) -> None:
    """X13 with micro-batches: a step's verify rows split among them, each sequence's rows in
    one, and the logits come back in step order."""
    bb: Backbone = request.getfixturevalue(which)
    plain, _ = _served(bb, 1, None)
    for mb in (2, 3):
        got, drafted = _served(bb, mb, DraftPlan("ngram", 3))
        assert got == plain and drafted > 0
