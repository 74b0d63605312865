"""X13 in the engine: with n-gram drafts on, every family's sequences get exactly the tokens
they get with drafts off, told in the same order one token per sequence per round, while
greedy sequences with drafts, greedy ones without and sampled ones share each step."""

from __future__ import annotations

import pytest
import torch

from kvq import wire
from kvq.coordinator.drafts import DraftPlan
from kvq.coordinator.engine import Engine, Sequence
from kvq.model import Backbone, SeqStep
from kvq.text import ByteTokenizer
from kvq.tools.synth import make_tiny

FAMILIES = [
    ("qwen3moe", ""),
    ("qwen2moe", ""),
    ("mixtral", ""),
    ("olmoe", ""),
    ("glm4moe", ""),
    ("deepseek2", "v3"),
    ("gpt-oss", ""),
    ("qwen35moe", ""),
]
PROMPTS = [
    [5, 9, 13, 7, 5, 9, 13, 21, 3, 5, 9],
    [2, 4, 6, 8, 2, 4, 6],
    [40, 41, 42, 40, 41],
    [70, 71, 72, 73, 70, 71],
]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f[0])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    arch, variant = request.param
    path = tmp_path_factory.mktemp("spec") / f"{arch}.gguf"
    make_tiny(path, arch=arch, variant=variant, layers=3, hidden=64, expert_ffn=64, seed=5)
    return Backbone.from_gguf(path)


def _serve(
    bb: Backbone, drafts: DraftPlan | None, greedy: wire.SamplingParams | None = None
) -> tuple[dict[str, list[int]], int, int]:
    """Every prompt's tokens as the sink is told them, the steps and the forward rows."""
    engine = Engine(bb, ByteTokenizer(), n_slots=4, drafts=drafts)
    sampled = wire.SamplingParams(temperature=0.8, seed=11, draft_max=0)  # shares, no drafts
    for i, p in enumerate(PROMPTS):
        engine.admit(f"r{i}", p, 20 - i, b"", sampled if i == 3 else greedy)
    told: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}

    def sink(seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.new_token is not None:
                told[s.request_id].append(s.new_token)

    rows = []
    forward = bb.forward

    def counting(steps: list[SeqStep], moe: object = None) -> torch.Tensor:
        rows.append(sum(len(st.tokens) for st in steps))
        return forward(steps, moe=moe)  # type: ignore[arg-type]

    bb.forward = counting  # type: ignore[method-assign]
    try:
        steps = 0
        while engine.busy:
            engine.step(None, sink)
            steps += 1
    finally:
        del bb.forward
    return told, steps, sum(rows)


def test_drafts_give_plain_decodings_tokens(model: Backbone) -> None:
    plain, plain_steps, plain_rows = _serve(model, None)
    got, steps, rows = _serve(model, DraftPlan("ngram", 4))
    assert got == plain
    assert [len(t) for t in plain.values()] == [20, 19, 18, 17]
    assert steps <= plain_steps
    assert rows > plain_rows  # drafts were verified


def test_drafts_off_by_default_and_with_a_chain(model: Backbone) -> None:
    assert not Engine(model, ByteTokenizer(), 1).drafts.on
    assert DraftPlan("ngram", 4).on and not DraftPlan("ngram", 0).on


def test_a_request_caps_or_opts_out_of_drafts(model: Backbone) -> None:
    plain, plain_steps, plain_rows = _serve(model, None)
    out = wire.SamplingParams(draft_max=0)
    assert _serve(model, DraftPlan("ngram", 4), out) == (plain, plain_steps, plain_rows)
    one, _, rows = _serve(model, DraftPlan("ngram", 4), wire.SamplingParams(draft_max=1))
    assert one == plain and rows > plain_rows


def test_sampled_sequences_draft_and_finish(model: Backbone) -> None:
    """Sampled sequences verify drafts by the speculative sampling rule beside greedy ones;
    greedy tokens stay plain decoding's, and a seeded sampled run repeats itself."""
    plain, _, _ = _serve(model, None)

    def run() -> tuple[dict[str, list[int]], int]:
        engine = Engine(model, ByteTokenizer(), n_slots=4, drafts=DraftPlan("ngram", 4))
        for i, p in enumerate(PROMPTS):
            hot = wire.SamplingParams(temperature=0.3, seed=i)
            engine.admit(f"r{i}", p, 20 - i, b"", hot if i % 2 else None)
        out: dict[str, list[int]] = {}
        while engine.busy:
            for seq in engine.step(None, lambda seqs: None):
                out[seq.request_id] = seq.generated
        return out, engine.spec.drafted

    got, drafted = run()
    assert got["r0"] == plain["r0"] and got["r2"] == plain["r2"]
    assert 0 < len(got["r1"]) <= 19 and 0 < len(got["r3"]) <= 17 and drafted > 0
    assert run()[0] == got
