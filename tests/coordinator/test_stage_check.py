"""The referee of stage answers (X3 at stage grain): the coordinator's own run of a span over a
sequence's inputs, chunk by chunk as the holders ran them, equals the holder's answer for the
last chunk; two holders' answers that disagree are decided by it (the liar caught, the honest
one used and credited); with no copy of the span, none is used."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.pending import Answer
from kvq.coordinator.stage_check import Referee, rule
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verifier
from kvq.gguf import read_meta
from kvq.gguf.registry import plan_stages
from kvq.model import Backbone
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "olmoe.gguf"
    make_tiny(path, arch="olmoe", layers=2, experts=8, seed=4, quant="q4_k_m")
    return path


def _holder_run(path: Path, chunks: list[torch.Tensor]) -> torch.Tensor:
    """What a holder of span 0 answers for the last of `chunks`, having run the others."""
    bb = Backbone.from_gguf(path, span=range(0, 1), head=False)
    cache, y = bb.new_cache(), torch.empty(0)
    for x in chunks:
        y = bb.run_span(x, [cache], [int(x.shape[0])])
        Backbone.advance_caches([cache], [int(x.shape[0])])
    return y


def _verifier() -> Verifier:
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    return Verifier(MemoryBoard(), "m", trust, "sampled", "float32", DispatchCounters())


def test_the_referee_replays_the_chunks_as_the_holders_ran_them(model: Path) -> None:
    specs = plan_stages(read_meta(model), model, 1)
    hidden = read_meta(model).embedding_length
    g = torch.Generator().manual_seed(0)
    chunks = [
        torch.randn(5, hidden, generator=g),
        torch.randn(1, hidden, generator=g),
        torch.randn(1, hidden, generator=g),
    ]
    got = Referee(model, specs).recompute(0, [chunks, chunks[:1]])
    assert got is not None and got.shape == (6, hidden)
    assert torch.equal(got[:1], _holder_run(model, chunks))
    assert torch.equal(got[1:], _holder_run(model, chunks[:1]))


@pytest.mark.parametrize("liar_first", [True, False])
def test_a_disagreement_is_decided_by_the_referee(model: Path, liar_first: bool) -> None:
    specs = plan_stages(read_meta(model), model, 1)
    hidden = read_meta(model).embedding_length
    chunks = [torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))]
    honest = Answer("honest", _holder_run(model, chunks), "float32")
    liar = Answer("liar", honest.y * 1.01, "float32")
    a, b = (liar, honest) if liar_first else (honest, liar)
    v = _verifier()
    ruling = rule(v, Referee(model, specs), 0, a, b, [chunks])
    assert ruling.use is honest and ruling.caught == ["liar"]
    assert v.barred("liar") and not v.barred("honest")
    assert v.stats.mismatches == 1 and v.trust.workers["honest"].ok == 1


def test_under_one_label_a_lie_inside_float32s_tolerance_is_caught(model: Path) -> None:
    """A holder of the referee's own label (`Referee.numerics`) that scales its rows by
    1.00005 (inside float32's tolerances: 1e-3 of a row, 1e-4 of bias) is caught; the honest
    holder is used."""
    specs = plan_stages(read_meta(model), model, 1)
    hidden = read_meta(model).embedding_length
    chunks = [torch.randn(4, hidden, generator=torch.Generator().manual_seed(2))]
    referee = Referee(model, specs)
    label = referee.numerics()
    assert label, "this machine's CPU path has a label"
    honest = Answer("honest", _holder_run(model, chunks), "q8", label)
    liar = Answer("liar", honest.y * 1.00005, "q8", label)
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    v = Verifier(MemoryBoard(), "m", trust, "sampled", "q8", DispatchCounters())
    ruling = rule(v, referee, 0, liar, honest, [chunks])
    assert ruling.use is honest and ruling.caught == ["liar"]


def test_without_the_span_here_no_answer_is_used_and_nobody_is_blamed(model: Path) -> None:
    specs = plan_stages(read_meta(model), model, 1)
    hidden = read_meta(model).embedding_length
    y = torch.randn(1, hidden)
    v = _verifier()
    ruling = rule(
        v,
        Referee(None, specs),
        0,
        Answer("a", y, "float32"),
        Answer("b", y + 1, "float32"),
        [[torch.randn(1, hidden)]],
    )
    assert ruling.use is None and ruling.caught == [] and "no answer is used" in ruling.why
    assert v.stats.unresolved == 1 and not v.barred("a") and not v.barred("b")
