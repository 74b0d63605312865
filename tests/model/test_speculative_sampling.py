"""X13 with sampling: `Sampler.speculate` keeps an n-gram draft token with probability p(d)
and otherwise draws from p without it, so the token it gives follows the target's
distribution p exactly (checked statistically against `Sampler.probs`)."""

from __future__ import annotations

import math

import pytest
import torch

from kvq.model.sampling import Sampler, Sampling

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
N = 20_000


@pytest.mark.parametrize(
    ("sampling", "draft"),
    [
        (Sampling(temperature=0.9, seed=1), 0),  # a likely draft
        (Sampling(temperature=0.9, seed=2), 3),  # an unlikely one
        (Sampling(temperature=1.2, top_p=0.8, seed=3), 5),  # outside the nucleus: p(d) = 0
        (Sampling(temperature=0.7, top_k=3, seed=4), 4),
    ],
)
def test_speculate_follows_the_target_distribution(sampling: Sampling, draft: int) -> None:
    s = Sampler(sampling, len(LOGITS))
    p = s.probs(LOGITS)
    p = p / p.sum()  # top-p drops mass: a draw renormalises
    counts = torch.zeros(len(LOGITS))
    for _ in range(N):
        counts[s.speculate(LOGITS, draft)] += 1
    freq = counts / N
    for v in range(len(LOGITS)):
        sd = math.sqrt(float(p[v]) * (1 - float(p[v])) / N)
        assert abs(float(freq[v] - p[v])) <= 5 * sd + 1e-9, (v, freq.tolist(), p.tolist())
    # chi-square over the tokens p allows (df <= 5: 30 is far beyond its 0.9999 quantile)
    allowed = p > 0
    chi2 = float((((counts - N * p) ** 2)[allowed] / (N * p[allowed])).sum())
    assert chi2 < 30, chi2
    assert counts[~allowed].sum() == 0


def test_speculate_greedy_and_penalised_are_picks() -> None:
    g = Sampler(Sampling(), len(LOGITS))
    assert g.speculate(LOGITS, 3) == 0 and g.speculate(LOGITS, 0) == 0
    a = Sampler(Sampling(presence_penalty=2.0), len(LOGITS))
    b = Sampler(Sampling(presence_penalty=2.0), len(LOGITS))
    assert [a.speculate(LOGITS, 1) for _ in range(4)] == [b.pick(LOGITS) for _ in range(4)]
