"""The clients people use against `kvq api` (X14): langchain-openai (`bind_tools` round trip
with a tool result, `with_structured_output` in its three modes, the completion model's
`batch`) and litellm (tools and `response_format` through its `openai/` and `hosted_vllm/`
providers). Each skips only where its library is missing (the `clients` test extra).

The model is the tiny BPE one with Qwen3.5's chat template (`tests/model/templates/`): a
template that renders tools and the `tool` role, as tests/model/test_model_tool_calls.py shows
per family (the tiny model's own template refuses them)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, System

from kvq.text import load_tokenizer
from kvq.tools.synth import bpe
from kvq.tools.synth.tiny import TinyConfig, family_parts, write_tiny

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TEMPLATE = Path(__file__).parents[1] / "model" / "templates" / "Qwen3.5-4B.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather of a city", "parameters": WEATHER},
}


@pytest.fixture(scope="module")
def api_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The system's model: tiny BPE weights, Qwen3.5's chat template."""
    path = tmp_path_factory.mktemp("clients-model") / "tiny-qwen35.gguf"
    vocab = bpe.tiny_vocab(0)
    cfg = TinyConfig(2, 8, 2, 64, 64, 4, 2, 16, 0)
    cfg = replace(family_parts(cfg, "qwen3moe"), vocab=len(vocab.tokens), context=4096)
    template = TEMPLATE.read_text(encoding="utf-8")

    def tokenizer(w: Any) -> None:
        bpe.add_vocab(w, vocab)
        w.add_chat_template(template)

    write_tiny(path, cfg, seed=3, tokenizer=tokenizer)
    return path


def _chat(system: System, **kw: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    kw = {"temperature": 0, "max_tokens": 120} | kw
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw
    )


def test_langchain_bind_tools_round_trip_with_a_tool_result(system: System) -> None:
    messages = pytest.importorskip("langchain_core.messages")
    llm = _chat(system)
    ask = [messages.HumanMessage("What is the weather in Paris?")]
    called = llm.bind_tools([TOOL], tool_choice="get_weather").invoke(ask)
    assert len(called.tool_calls) == 1, called
    call = called.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER)
    result = messages.ToolMessage("sunny, 21C", tool_call_id=call["id"])
    answer = llm.bind_tools([TOOL]).invoke([*ask, called, result])  # the result goes back
    assert isinstance(answer, messages.AIMessage) and isinstance(answer.content, str)
    first = called.usage_metadata["input_tokens"]
    assert answer.usage_metadata["input_tokens"] > first  # the call and its result rendered


@pytest.mark.parametrize("method", ["function_calling", "json_mode", "json_schema"])
def test_langchain_with_structured_output(system: System, method: str) -> None:
    kw: dict[str, Any] = {"max_tokens": 400}
    if method == "json_mode":  # any object: random weights wander in a string for long, so
        tok = load_tokenizer(system.model_path)  # closing a string or an object is favoured
        kw["logit_bias"] = {tok.encode(c, add_bos=False)[0]: 6 for c in ('"', "}")}
    llm = _chat(system, **kw)
    schema = {"title": "weather", "description": "weather of a city", **WEATHER}
    structured = llm.with_structured_output(schema, method=method)
    got = structured.invoke("Weather in Paris as JSON?")
    assert isinstance(got, dict)
    if method != "json_mode":  # json_mode asks for any JSON object, not this schema
        jsonschema.validate(got, WEATHER)


def test_langchain_completion_batch(system: System) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        model=MODEL,
        base_url=system.url + "/v1",
        api_key="none",
        max_retries=0,
        timeout=120,
        temperature=0,
        max_tokens=4,
        batch_size=3,
    )
    prompts = ["one", "two", "three"]
    got = llm.batch(prompts)
    alone = [llm.invoke(p) for p in prompts]
    assert got == alone and all(isinstance(t, str) for t in got)
    generated = llm.generate(prompts)  # one call with the list of prompts
    assert [g[0].text for g in generated.generations] == alone


@pytest.mark.filterwarnings("ignore:Items? .* using the .ReadOnly. qualifier:UserWarning")
@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_tools_and_response_format(
    system: System, provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network
    litellm = pytest.importorskip("litellm")
    common: dict[str, Any] = {
        "model": f"{provider}/{MODEL}",
        "api_base": system.url + "/v1",
        "api_key": "none",
        "max_tokens": 120,
        "temperature": 0,
        "timeout": 120,
        "num_retries": 0,
    }
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = litellm.completion(messages=msgs, tools=[TOOL], tool_choice="required", **common)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    back = [
        *msgs,
        r.choices[0].message.model_dump(),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    after = litellm.completion(messages=back, tools=[TOOL], **common)
    assert after.usage.prompt_tokens > r.usage.prompt_tokens
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    r = litellm.completion(messages=msgs, response_format=rf, **common)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    r = litellm.completion(messages=msgs, response_format={"type": "json_object"}, **common)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
