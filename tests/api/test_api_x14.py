"""The API that agent frameworks and evaluation harnesses use (X14), on a real system
(embedded Redis, a coordinator, `kvq api` as its own process) with the official `openai`
client: structured output by constrained decoding, tools, several prompts and choices,
prompt log-probabilities, `logit_bias`, `/tokenizer_info`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from conftest import MODEL, System
from openai import BadRequestError, OpenAI

from kvq.model import Backbone, KVCache, SeqStep
from kvq.text import load_tokenizer

pytestmark = pytest.mark.slow  # a system of kvq roles or processes

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather of a city", "parameters": SCHEMA},
}


def _client(system: System) -> OpenAI:
    return OpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_json_schema_answers_all_validate(system: System) -> None:
    oai = _client(system)
    rf: Any = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
    }
    texts = []
    for seed in (1, 2):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather?"}],
            n=8,
            seed=seed,
            max_tokens=120,
            temperature=1.0,
            response_format=rf,
        )
        assert len(r.choices) == 8 and [c.index for c in r.choices] == list(range(8))
        texts += [c.message.content or "" for c in r.choices]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=300,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=5,
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_bad_schema_and_bias_are_400_naming_the_parameter(system: System) -> None:
    oai = _client(system)
    msgs: Any = [{"role": "user", "content": "x"}]
    bad = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format.json_schema",
        ),
        ({"extra_body": {"grammar": "root ::= ("}}, "grammar"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1000}}, "logit_bias"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ]
    for kw, param in bad:
        with pytest.raises(BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert e.value.body["param"] == param, kw  # type: ignore[index]


def test_named_tool_call_round_trip(system: System) -> None:
    oai = _client(system)
    msgs: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    for stream in (False, True):
        choice: Any = {"type": "function", "function": {"name": "get_weather"}}
        if not stream:
            r = oai.chat.completions.create(
                model=MODEL,
                messages=msgs,
                tools=[WEATHER],
                tool_choice=choice,
                max_tokens=150,
                temperature=0,
            )
            calls, finish = r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
        else:
            chunks = list(
                oai.chat.completions.create(
                    model=MODEL,
                    messages=msgs,
                    tools=[WEATHER],
                    tool_choice=choice,
                    max_tokens=150,
                    temperature=0,
                    stream=True,
                )
            )
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            finish = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
        assert finish == "tool_calls" and len(calls) == 1
        fn = calls[0].function
        assert fn is not None and fn.name == "get_weather"
        jsonschema.validate(json.loads(fn.arguments or ""), SCHEMA)
    back = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": fn.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21C"},
    ]
    with pytest.raises(BadRequestError) as e:  # the tiny model's template knows no tools:
        oai.chat.completions.create(  # a real refusal, as its file says (the families' own
            model=MODEL,
            messages=back,
            tools=[WEATHER],
            max_tokens=5,  # templates render them:
        )  # tests/model/test_model_tool_calls.py)
    assert "unknown role tool" in str(e.value)


def test_several_prompts_n_and_best_of_are_batched_sequences(system: System) -> None:
    oai = _client(system)
    r = oai.completions.create(
        model=MODEL, prompt=["one", "two", [1, 2, 3]], max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [
        oai.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        for p in ("one", "two")
    ]
    assert [c.text for c in r.choices[:2]] == [a.choices[0].text for a in alone]
    assert r.usage is not None and alone[0].usage and alone[1].usage
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens + 3
    a = oai.completions.create(
        model=MODEL, prompt="seeded", n=4, seed=9, max_tokens=8, temperature=1.0
    )
    b = oai.completions.create(
        model=MODEL, prompt="seeded", n=4, seed=9, max_tokens=8, temperature=1.0
    )
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # independent samples
    best = oai.completions.create(
        model=MODEL, prompt="best", n=2, best_of=4, seed=3, max_tokens=6, temperature=1.0
    )
    assert len(best.choices) == 2 and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 4 * 6


def test_echo_gives_the_prompt_logprobs_of_a_forward_pass(system: System) -> None:
    ids = [256, 117, 104, 101, 32, 113, 117]
    r = httpx.post(
        system.url + "/v1/completions",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": [ids, ids[:4]],
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    bb, tok = Backbone.from_gguf(system.model_path), load_tokenizer(system.model_path)
    for choice, p in zip(r.json()["choices"], [ids, ids[:4]], strict=True):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(p)
        cache: KVCache = bb.new_cache()
        want = []
        for i, t in enumerate(p[:-1]):
            logits = bb.forward([SeqStep([t], cache)])[0]
            want.append(float(torch.log_softmax(logits.float(), -1)[p[i + 1]]))
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert choice["text"] == tok.decode(p) and choice["finish_reason"] == "length"
        assert all(
            max(t.values()) >= v
            for t, v in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:], strict=True)
        )
    assert r.json()["usage"]["completion_tokens"] == 0


def test_logit_bias_and_tokenizer_info(system: System) -> None:
    oai = _client(system)
    tok = load_tokenizer(system.model_path)
    z = tok.encode("z", add_bos=False)[0]
    r = oai.completions.create(
        model=MODEL, prompt="hi", max_tokens=5, temperature=0, logit_bias={str(z): 100}
    )
    assert r.choices[0].text == "z" * 5
    info = httpx.get(system.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token_id"] == tok.eos_id and info["model_max_length"] > 0
    assert "chat_template" in info
    got = httpx.post(
        system.url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}, timeout=30
    ).json()  # no model: the only one registered
    assert got["tokens"] == tok.encode("hi", add_bos=False)


def test_prompt_logprobs_as_vllm_gives_them(system: System) -> None:
    ids = [256, 117, 104, 101, 32, 113]
    r = httpx.post(
        system.url + "/v1/completions",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": ids,
            "prompt_logprobs": 2,
            "max_tokens": 2,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plain = httpx.post(
        system.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0},
    ).json()["choices"][0]
    assert choice["text"] == plain["text"]  # the prompt is not echoed
    lp = choice["prompt_logprobs"]
    assert lp[0] is None and len(lp) == len(ids)
    bb = Backbone.from_gguf(system.model_path)
    cache: KVCache = bb.new_cache()
    for i, t in enumerate(ids[:-1]):
        logits = torch.log_softmax(bb.forward([SeqStep([t], cache)])[0].float(), -1)
        entry = lp[i + 1]
        assert entry[str(ids[i + 1])]["logprob"] == pytest.approx(
            float(logits[ids[i + 1]]), abs=1e-5
        )
        best = torch.topk(logits, 2).indices.tolist()
        ranked = {int(k): v["rank"] for k, v in entry.items() if v["rank"] is not None}
        assert ranked == {best[0]: 1, best[1]: 2}  # the prompt token's rank only among them
    chat = httpx.post(
        system.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "prompt_logprobs": 0,
            "max_tokens": 2,
        },
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # the prompt token alone


def test_several_choices_stream_token_by_token(system: System) -> None:
    oai = _client(system)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 4}
    whole = oai.completions.create(prompt=["one", "two"], n=2, **kw)
    chunks = list(
        oai.completions.create(
            prompt=["one", "two"], n=2, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    texts: dict[int, str] = {}
    pieces: dict[int, int] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            pieces[ch.index] = pieces.get(ch.index, 0) + bool(ch.text)
    assert texts == {c.index: c.text for c in whole.choices}
    assert all(n > 1 for n in pieces.values()), pieces  # token by token, not the whole text
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    chat = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=3,
            seed=2,
            max_tokens=5,
            temperature=1.0,
            stream=True,
        )
    )
    roles = [c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role]
    finishes = [c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
