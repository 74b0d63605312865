"""The sampler against the tiny model's own probabilities (chi-square), the stop-string
detokenizer, and chat templates rendered as a reference jinja2 rendering."""

from __future__ import annotations

import math
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch

from kvq.coordinator.detok import StopText
from kvq.errors import ModelError
from kvq.model import Backbone, SeqStep
from kvq.model.sampling import Sampler, Sampling
from kvq.text import load_tokenizer
from kvq.text.chat import CHATML, ChatTemplate, load_chat_template
from kvq.tools.synth import make_tiny
from kvq.tools.synth.tiny import CHAT_TEMPLATE

DRAWS = 20_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sampling") / "m.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3, tokenizer="bpe")
    return path


@pytest.fixture(scope="module")
def logits(tiny: Path) -> torch.Tensor:
    bb = Backbone.from_gguf(tiny)
    with torch.inference_mode():
        return bb.forward([SeqStep(load_tokenizer(tiny).encode("once upon"), bb.new_cache())])[0]


def expected(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """The distribution a draw should follow, computed independently in float64 numpy."""
    z = logits.double().numpy() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = order[before < top_p]  # the smallest prefix whose mass reaches top_p
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()  # type: ignore[no-any-return]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.5, 0.8)])
def test_draws_follow_the_models_probabilities(
    logits: torch.Tensor, temperature: float, top_p: float
) -> None:
    sampler = Sampler(Sampling(temperature=temperature, top_p=top_p, seed=1), logits.shape[0])
    counts = np.bincount([sampler.pick(logits) for _ in range(DRAWS)], minlength=logits.shape[0])
    p = expected(logits, temperature, top_p)
    assert counts[p == 0].sum() == 0, "nothing outside the nucleus is ever drawn"
    big = p * DRAWS >= 5  # chi-square wants >= 5 expected per cell: pool the rest
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big] * DRAWS, p[~big].sum() * DRAWS)
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert len(obs) > 5, "a distribution, not a few tokens"
    assert stat < chi2_critical(len(obs) - 1), (stat, len(obs))
    # and the test can fail: the same draws against the untempered distribution
    if temperature != 1.0:
        q = expected(logits, 1.0, 1.0)
        wrong = float(((counts[big] - q[big] * DRAWS) ** 2 / (q[big] * DRAWS)).sum())
        assert wrong > chi2_critical(int(big.sum()) - 1)


def test_a_seed_repeats_and_greedy_is_argmax(logits: torch.Tensor) -> None:
    def draws(seed: int) -> list[int]:
        s = Sampler(Sampling(temperature=1.0, seed=seed), logits.shape[0])
        return [s.pick(logits) for _ in range(50)]

    assert draws(4) == draws(4) != draws(5)
    assert Sampler(Sampling(), logits.shape[0]).pick(logits) == int(logits.argmax())


def test_penalties_lower_what_was_generated(logits: torch.Tensor) -> None:
    s = Sampler(Sampling(frequency_penalty=2.0), logits.shape[0])
    first = s.pick(logits)
    assert first == int(logits.argmax())
    flat = torch.zeros_like(logits)
    flat[first] = 1.0  # ahead by 1.0: after one occurrence it is 2.0 down, so another wins
    assert s.pick(flat) != first


# -- stop strings ------------------------------------------------------------------------
def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def feed(stops: list[str], text: str) -> tuple[list[str], StopText]:
    st, out, ids = StopText(decode, stops), [], []
    for ch in text:
        ids.append(ord(ch))
        out.append(st.push(ids))
        if st.stopped:
            break
    else:
        out.append(st.flush(ids))
    return out, st


def test_stop_string_across_pieces_is_never_handed_out() -> None:
    out, st = feed(["END"], "abcENxENDzz")
    assert st.stopped and "".join(out) == "abcENx" and st.text == "abcENx"
    assert out[:6] == ["a", "b", "c", "", "", "ENx"], "a possible start is held back"


def test_no_stop_hands_out_everything() -> None:
    out, st = feed(["END"], "abcEN")
    assert not st.stopped and "".join(out) == "abcEN" and out[-1] == "EN"


def test_unfinished_characters_are_held_back() -> None:
    # ids ending in 1 decode to an unfinished character; a 0 completes it
    st = StopText(lambda ids: ("ab" + "\ufffd" * ids[-1]) if ids else "", [])
    assert st.push([1]) == "" and st.text == ""
    assert st.push([1, 0]) == "ab" and st.flush([1, 0]) == ""


def test_incremental_text_equals_decoding_everything(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    ids = tok.encode("héllo wörld, the quick brown fox — 日本語 ok")[1:]
    st, out = StopText(tok.decode, []), []
    for i in range(1, len(ids) + 1):
        out.append(st.push(ids[:i]))
    out.append(st.flush(ids))
    assert "".join(out) == tok.decode(ids) == st.text


# -- chat templates -----------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "  be brief "},
    {"role": "user", "content": "héllo {{ 7*7 }}"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "again"},
]


def reference(source: str, messages: list[dict[str, str]], **kw: object) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kw)


def test_tiny_models_carry_their_template(tiny: Path) -> None:
    chat = load_chat_template(tiny)
    assert chat.source == CHAT_TEMPLATE != CHATML
    assert chat.render(MESSAGES) == reference(CHAT_TEMPLATE, MESSAGES)
    assert "{{ 7*7 }}" in chat.render(MESSAGES), "content is data, never template code"
    with pytest.raises(ModelError, match="unknown role"):
        chat.render([{"role": "tool", "content": "x"}])


def test_chatml_fallback(tmp_path: Path) -> None:
    path = tmp_path / "plain.gguf"
    make_tiny(path, layers=1, experts=4, experts_used=2, tokenizer=_no_template)
    chat = load_chat_template(path)
    assert chat.source == CHATML
    got = chat.render(MESSAGES)
    assert got == reference(CHATML, MESSAGES)
    assert got.endswith("<|im_start|>assistant\n") and got.count("<|im_end|>") == 4


def _no_template(w: object) -> None:
    from kvq.tools.synth.tiny import _byte_tokenizer

    _byte_tokenizer(w)  # type: ignore[arg-type]


def test_the_sandbox_refuses_unsafe_templates() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ModelError, match="refused"):
        ChatTemplate(evil).render(MESSAGES)
    with pytest.raises(ModelError, match="refused"):
        ChatTemplate("{% set _ = messages.append(1) %}").render(MESSAGES)
    bos = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] | tojson }}", bos_token="<s>")
    assert bos.render(MESSAGES) == '<s>"  be brief "'
