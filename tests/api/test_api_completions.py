"""Completions and chat completions through `kvq api` with the official `openai` client, on a
real system (tests/api/conftest.py): the response contract, streaming, stop strings, seeds,
logprobs and the chat template."""

from __future__ import annotations

import math

import jinja2
import pytest
import torch
from conftest import MODEL, System
from openai import OpenAI

from kvq.model import Backbone, SeqStep
from kvq.model.generate import Sampling, generate
from kvq.text import load_tokenizer
from kvq.tools.synth.tiny import CHAT_TEMPLATE

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def oai(system: System) -> OpenAI:
    return OpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def backbone(system: System) -> Backbone:
    return Backbone.from_gguf(system.model_path)


def local_text(system: System, bb: Backbone, prompt: str, n: int, s: Sampling | None) -> str:
    tok = load_tokenizer(system.model_path)
    return tok.decode(generate(bb, tok.encode(prompt), n, sampling=s))


def test_models_lists_the_registered_model(oai: OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_completion_contract_and_greedy_equals_local(
    oai: OpenAI, system: System, backbone: Backbone
) -> None:
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.created > 0 and len(r.choices) == 1
    (c,) = r.choices
    assert c.finish_reason == "length" and c.index == 0
    assert c.text == local_text(system, backbone, PROMPT, 12, None)
    n_prompt = len(load_tokenizer(system.model_path).encode(PROMPT))
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)
    assert r.usage.total_tokens == n_prompt + 12


def test_streamed_completion_equals_the_whole_one(oai: OpenAI) -> None:
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.id.startswith("cmpl-") and ch.model == MODEL for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == whole.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert len(texts) > 2, "streamed token by token, not in one piece"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_streamed_and_not(oai: OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == c.message.content
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_chat_prompt_is_the_files_template_rendered(oai: OpenAI, system: System) -> None:
    msgs = [{"role": "system", "content": " terse "}, {"role": "user", "content": "hi there"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    ref = env.from_string(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    assert ref.endswith("### Assistant:\n") and "### System:\nterse\n" in ref
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(load_tokenizer(system.model_path).encode(ref))


def test_stop_string_spanning_tokens_ends_the_text_before_it(oai: OpenAI, system: System) -> None:
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    tok = load_tokenizer(system.model_path)
    # a stop string that starts inside one token and ends inside a later one
    ids = tok.encode(PROMPT)
    gen = generate(Backbone.from_gguf(system.model_path), ids, 24)
    pieces = [tok.decode(gen[:i]) for i in range(len(gen) + 1)]

    def span(k: int) -> tuple[int, int]:  # last char of token k .. first char of token k+2
        return len(pieces[k]) - 1, len(pieces[k + 1]) + 1

    def fits(k: int) -> bool:
        start, end = span(k)
        stop = text[start:end]
        return (
            len(pieces[k]) - len(pieces[k - 1]) >= 2
            and end <= len(pieces[k + 2])
            and "\ufffd" not in stop
            and text.find(stop) == start
        )

    assert pieces[-1] == text
    start, end = span(next(k for k in range(1, len(gen) - 2) if fits(k)))
    stop = text[start:end]
    assert len(stop) >= 3
    for stream in (False, True):
        r = oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=[stop, "zzzq"],
            stream=stream,
        )
        if stream:
            chunks = list(r)  # type: ignore[arg-type]
            got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].text, r.choices[0].finish_reason  # type: ignore[union-attr]
        assert got == text[:start], "cut before the stop string, which is never sent"
        assert finish == "stop"


def test_seed_reproducible_and_equal_to_local(
    oai: OpenAI, system: System, backbone: Backbone
) -> None:
    def ask(seed: int) -> str:
        r = oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=seed
        )
        return r.choices[0].text

    a, b, c = ask(7), ask(7), ask(8)
    assert a == b and a != c
    local = local_text(system, backbone, PROMPT, 16, Sampling(temperature=0.9, top_p=0.95, seed=7))
    assert a == local, "remote equals local `kvq generate` for a fixed seed"


def reference_logprobs(bb: Backbone, ids: list[int], n: int) -> list[torch.Tensor]:
    """log_softmax of the logits at each greedy step, [V] each."""
    cache, step, out = bb.new_cache(), list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            ref = torch.log_softmax(bb.forward([SeqStep(step, cache)])[0].float(), -1)
            out.append(ref)
            step = [int(ref.argmax())]
    return out


def test_logprobs_are_log_softmax_of_the_logits(
    oai: OpenAI, system: System, backbone: Backbone
) -> None:
    tok = load_tokenizer(system.model_path)
    ids = tok.encode(PROMPT)
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    for got, top, ref in zip(
        lp.token_logprobs, lp.top_logprobs, reference_logprobs(backbone, ids, 6), strict=True
    ):
        assert math.isclose(got, float(ref.max()), abs_tol=1e-4)
        best = torch.topk(ref, 5).values.tolist()
        # keyed by token text, so tokens with the same text collapse (as in OpenAI's format)
        assert 0 < len(top) <= 5 and all(any(abs(v - b) < 1e-4 for b in best) for v in top.values())

    msgs = [{"role": "user", "content": "x"}]
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=5,  # type: ignore[arg-type]
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    refs = reference_logprobs(backbone, tok.encode(prompt), 4)
    assert content is not None and len(content) == 4
    for t, ref in zip(content, refs, strict=True):
        best = torch.topk(ref, 5).values.tolist()
        assert math.isclose(t.logprob, best[0], abs_tol=1e-4)
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(best, abs=1e-4)
