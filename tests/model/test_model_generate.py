"""kvq.model.generate: greedy by default, seeded sampling, streaming callback."""

from __future__ import annotations

import pytest

from kvq.errors import ModelError
from kvq.model import Backbone
from kvq.model.generate import Sampling, generate

PROMPT = [256, 104, 101, 108, 108, 111]


def test_greedy_and_top_k_1_equal_backbone_generate(odd_backbone: Backbone) -> None:
    want = generate(odd_backbone, PROMPT, 10, stop_at_eos=False)
    seen: list[int] = []
    got = generate(odd_backbone, PROMPT, 10, stop_at_eos=False, on_token=seen.append)
    assert got == seen == want
    top1 = Sampling(temperature=2.0, top_k=1, seed=3)
    assert generate(odd_backbone, PROMPT, 10, sampling=top1, stop_at_eos=False) == want


def test_sampling_is_reproducible_by_seed(odd_backbone: Backbone) -> None:
    def run(seed: int) -> list[int]:
        s = Sampling(temperature=1.2, top_p=0.9, seed=seed)
        return generate(odd_backbone, PROMPT, 16, sampling=s, stop_at_eos=False)

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        (Sampling(temperature=-1), "temperature -1"),
        (Sampling(top_k=-2), "top_k -2"),
        (Sampling(top_p=1.5), "top_p 1.5"),
    ],
)
def test_bad_sampling(odd_backbone: Backbone, sampling: Sampling, words: str) -> None:
    with pytest.raises(ModelError, match=words):
        generate(odd_backbone, PROMPT, 3, sampling=sampling)


def test_empty_prompt_and_zero_tokens(odd_backbone: Backbone) -> None:
    assert generate(odd_backbone, [], 0) == []
    with pytest.raises(ModelError, match="prompt is empty"):
        generate(odd_backbone, [], 3)
