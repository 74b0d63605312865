"""X13 on every family's tiny model: a speculative pass's rows are the bits of plain decode
steps after the same tokens (KV, latent, sliding-window and DeltaNet caches rolled back past
rejected drafts), so greedy generation with n-gram drafts gives exactly plain greedy
decoding's tokens, alone and with sequences with and without drafts sharing a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.model import Backbone
from kvq.model.cache import SeqStep
from kvq.model.generate import generate
from kvq.model.speculative import (
    DraftLength,
    SpecStats,
    accept_greedy,
    ngram_draft,
    speculative_greedy,
)
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
    ("llama4", ""),  # chunked attention, NoPE layers' temperature
]
_models: dict[str, Backbone] = {}


@pytest.fixture(params=FAMILIES, ids=lambda f: f[0])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    arch, variant = request.param
    if arch not in _models:
        path = tmp_path_factory.mktemp("spec") / f"{arch}.gguf"
        make_tiny(path, arch=arch, variant=variant, layers=3, hidden=64, expert_ffn=64, seed=5)
        _models[arch] = Backbone.from_gguf(path)
    return _models[arch]


PROMPT = [5, 9, 13, 7, 5, 9, 13, 21, 3, 5, 9]


def test_ngram_draft_takes_the_latest_longest_match() -> None:
    assert ngram_draft([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert ngram_draft([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 5) == [9, 1, 2, 3]
    assert ngram_draft([7, 8, 9], 3) == []
    assert ngram_draft([4, 4], 3) == [4]
    assert ngram_draft([1, 2, 1], 0) == []


def test_accept_greedy_keeps_the_matching_prefix_and_one_more() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 8, 6, 7]) == [4, 8]
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_greedy([], [3]) == [3]


def test_draft_length_adapts_to_acceptance() -> None:
    n = DraftLength(4)
    assert n.now == 4
    n.update(4, 1)
    assert n.now == 2
    n.update(2, 2)
    assert n.now == 3
    n.update(3, 0)
    assert n.now == 1


def _plain_rows(bb: Backbone, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """The logits of plain decoding after the prompt and after each token of `fed`."""
    cache = bb.new_cache()
    rows = [bb.forward([SeqStep(list(prompt), cache)])[0]]
    rows += [bb.forward([SeqStep([t], cache)])[0] for t in fed]
    return torch.stack(rows)


def test_verify_rows_are_decode_bits_and_roll_back(family: Backbone) -> None:
    """A speculative pass of 6 rows, 2 of them accepted, then another pass from there: every
    row the bits of a decode step, before and after the rollback, beside another sequence's
    prompt in the same step."""
    bb = family
    fed = [11, 4, 17, 2, 8, 30, 6, 1, 19, 12]
    want = _plain_rows(bb, PROMPT, fed)  # row i: after PROMPT + fed[:i]
    cache, other = bb.new_cache(), bb.new_cache()
    bb.forward([SeqStep(list(PROMPT), cache)])
    bb.forward([SeqStep([3, 1], other)])
    wrong = [fed[0], fed[1], 99, 98, 97, 96]
    got = bb.forward([SeqStep([9, 9, 9], other), SeqStep(wrong, cache, verify=True)])
    assert got.shape[0] == 1 + len(wrong)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    cache.advance(2)  # fed[0], fed[1] accepted; the rest rolled back
    got = bb.forward([SeqStep(fed[2:7], cache, verify=True), SeqStep([5], other)])
    for j in range(5):
        assert torch.equal(got[j], want[3 + j]), f"row {j}"
    cache.advance(5)
    assert torch.equal(bb.forward([SeqStep([fed[7]], cache)])[0], want[8])


def test_speculative_greedy_equals_plain_decoding(family: Backbone) -> None:
    bb = family
    prompts = [PROMPT, [2, 4, 6, 8, 2, 4, 6], [40, 41, 42, 40, 41]]
    plain = [generate(bb, p, 24, stop_at_eos=False) for p in prompts]
    stats = SpecStats()
    got = speculative_greedy(bb, prompts, 24, 4, stop_at_eos=False, stats=stats)
    assert got == plain
    assert stats.drafted > 0 and stats.tokens == 3 * 24
    assert stats.passes < 24 or stats.accepted == 0  # fewer passes whenever a draft is kept
    assert speculative_greedy(bb, [PROMPT], 24, 4, stop_at_eos=False) == plain[:1]


def test_speculative_greedy_stops_where_plain_decoding_does(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, arch="qwen3moe", layers=2, hidden=64, expert_ffn=64, seed=1)
    bb = Backbone.from_gguf(path)
    for n in (1, 2, 7):
        assert speculative_greedy(bb, [PROMPT], n, 3) == [generate(bb, PROMPT, n)]


def test_generate_with_drafts_reads_the_prompt_in_chunks_and_tells_each_token(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, arch="qwen35moe", layers=2, hidden=64, expert_ffn=64, seed=2)
    bb = Backbone.from_gguf(path)
    told: list[int] = []
    got = generate(bb, PROMPT, 20, chunk=4, draft_tokens=3, on_token=told.append)
    assert got == told == generate(bb, PROMPT, 20, chunk=4)
