"""Tool calls in each family's own format (X14): the format its chat template writes, tools
and a tool result rendered by the template as its file carries it, a constrained call on a
tiny random model that parses back into valid arguments, and a call written as the family
writes it parsed into `tool_calls`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvq import wire
from kvq.coordinator.engine import Engine
from kvq.model import Backbone
from kvq.prompts import render_chat
from kvq.text import load_tokenizer
from kvq.text import tool_calls as tc
from kvq.text.chat import ChatTemplate
from kvq.tools.synth import make_tiny

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from kvq.text.grammar import compile_grammar  # noqa: E402  (needs llguidance)

TEMPLATES = Path(__file__).parent / "templates"
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
FUNCTION = {"name": "get_weather", "description": "weather of a city", "parameters": PARAMS}
TOOL = {"type": "function", "function": FUNCTION}
FAMILIES = {  # template file → (format, a call as the family writes it)
    "Qwen3.5-4B.jinja": (
        "qwen-xml",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
        "</tool_call>",
    ),
    "GLM-4.6.jinja": (
        "glm",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>",
    ),
    "deepseek-ai-DeepSeek-V3.jinja": (
        "deepseek-v3",
        f"{tc.CALLS_BEGIN}{tc.CALL_BEGIN}function"
        f'{tc.CALL_SEP}get_weather\n```json\n{{"city": "Paris",'
        f' "days": 3}}\n```{tc.CALL_END}{tc.CALLS_END}',
    ),
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        "deepseek-v3.1",
        f"{tc.CALLS_BEGIN}{tc.CALL_BEGIN}"
        f'get_weather{tc.CALL_SEP}{{"city": "Paris", '
        f'"days": 3}}{tc.CALL_END}{tc.CALLS_END}',
    ),
    "openai-gpt-oss-120b.jinja": (
        "harmony",
        "<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris", "days": 3}'
        "<|call|>",
    ),
    "meta-llama-Llama-4.jinja": (
        "llama4",
        '<|python_start|>{"name": "get_weather", '
        '"parameters": {"city": "Paris", "days": 3}}'
        "<|python_end|>",
    ),
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
}
CHAT = [
    wire.ChatMessage(role="user", content="Weather in Paris?"),
    wire.ChatMessage(role="assistant", content="", tool_calls=json.dumps([CALL])),
    wire.ChatMessage(role="tool", content="sunny", tool_call_id="call_1", name="get_weather"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Backbone, object]:
    path = tmp_path_factory.mktemp("tc") / "m.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=5, tokenizer="bpe")
    return Backbone.from_gguf(path), load_tokenizer(path)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_template_tools_and_calls(name: str, model: tuple[Backbone, object]) -> None:
    fmt, written = FAMILIES[name]
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    assert tc.tool_format(source) == fmt
    # the template renders the tools (where it shows them), the call and the tool's answer
    text = render_chat(ChatTemplate(source), CHAT, json.dumps([TOOL]))
    assert "Paris" in text and "sunny" in text
    # a call written as the family writes it comes back as a tool call
    content, calls = tc.parse(fmt, "Let me look. " + written if fmt != "harmony" else written)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    # a constrained call on random weights: every one parses and validates
    bb, tok = model
    grammar = compile_grammar("lark", tc.call_grammar(fmt, [TOOL["function"]]))
    engine = Engine(bb, tok, n_slots=4)  # type: ignore[arg-type]
    for i in range(4):
        p = wire.SamplingParams(temperature=1.0, seed=i, grammar=grammar)
        engine.admit(str(i), tok.encode("hi"), 200, b"", p)  # type: ignore[attr-defined]
    done = []
    while engine.busy:
        done += engine.step(None, lambda seqs: None)
    assert len(done) == 4
    for seq in done:
        _, calls = tc.parse(fmt, tok.decode(seq.generated))  # type: ignore[attr-defined]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
