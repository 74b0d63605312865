"""The chat templates of the MoE families, as their model files carry them (tests/model/templates,
see its README), rendered in kvq's sandbox: the exact text, derived by reading each template,
and the same text as transformers' own renderer where transformers is installed."""

from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kvq.errors import ModelError
from kvq.text.chat import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NOW = datetime(2025, 8, 5, 12, 0)
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
U, A = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>hmm</think>Hello!"},
    {"role": "user", "content": "Weather?"},
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
]


def _render(name: str, messages: list[dict[str, Any]], bos: str = "", **kw: Any) -> str:
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    ours = ChatTemplate(source, bos, "", now=lambda: NOW).render(messages, **kw)
    if HAS_TRANSFORMERS:
        from transformers.utils import chat_template_utils as ctu

        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as
        with pytest.MonkeyPatch.context() as mp:  # apply_chat_template hands them over
            mp.setattr(ctu, "datetime", type("Clock", (), {"now": lambda: NOW}))
            theirs = ctu.render_jinja_template(
                [plain], chat_template=source, bos_token=bos, add_generation_prompt=True, **kw
            )[0][0]
        assert ours == theirs
    return ours


def test_deepseek_v3() -> None:
    name = "deepseek-ai-DeepSeek-V3.jinja"
    chat = [CHAT[0], {"role": "system", "content": "Answer in English."}, *CHAT[1:]]
    assert _render(name, chat, BOS) == (
        f"{BOS}Be brief.\n\nAnswer in English.{U}Hi{A}<think>hmm</think>Hello!{EOS}{U}Weather?{A}"
    )
    tool_result = [TOOL_CHAT[0], TOOL_CHAT[2], {"role": "assistant", "content": "It is sunny."}]
    out = "<\uff5ctool\u2581output"
    assert _render(name, tool_result, BOS) == (
        f"{BOS}{U}Weather in Paris?{out}s\u2581begin\uff5c>{out}\u2581begin\uff5c>sunny"
        f"{out}\u2581end\uff5c>{out}s\u2581end\uff5c>It is sunny.{EOS}{A}"
    )
    # its tool calls render only for `"content": None`, which kvq drops as transformers 5 does


def test_deepseek_v31() -> None:
    name = "deepseek-ai-DeepSeek-V3.1.jinja"
    assert _render(name, CHAT, BOS) == (
        f"{BOS}Be brief.{U}Hi{A}<think></think>Hello!{EOS}{U}Weather?{A}<think></think>"
    )
    assert _render(name, CHAT, BOS, thinking=True).endswith(f"{U}Weather?{A}<think>")
    call = '<\uff5ctool\u2581call\u2581begin\uff5c>get_weather<\uff5ctool\u2581sep\uff5c>{"city": "Paris"}'
    assert _render(name, TOOL_CHAT, BOS) == (
        f"{BOS}{U}Weather in Paris?{A}<think></think><\uff5ctool\u2581calls\u2581begin\uff5c>"
        f"{call}<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>{EOS}"
        "<\uff5ctool\u2581output\u2581begin\uff5c>sunny<\uff5ctool\u2581output\u2581end\uff5c>"
    )  # no generation prompt after a tool result: the template's own choice


def test_glm45() -> None:
    name = "GLM-4.6.jinja"
    assert _render(name, CHAT) == (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think></think>\nHello!"
        "<|user|>\nWeather?<|assistant|>"
    )
    assert _render(name, CHAT, enable_thinking=False).endswith(
        "<|user|>\nWeather?/nothink<|assistant|>\n<think></think>"
    )
    assert _render(name, TOOL_CHAT, tools=[TOOL]) == (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
        'tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string"}}, "required": ["city"]}}}\n</tools>\n\nFor each function call, output the '
        "function name and arguments within the following XML format:\n<tool_call>"
        "{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
        "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
        "<|user|>\nWeather in Paris?<|assistant|>\n<think></think>\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
        "<|observation|>\n<tool_response>\nsunny\n</tool_response><|assistant|>"
    )


def test_llama4() -> None:
    name = "meta-llama-Llama-4.jinja"
    bos = "<|begin_of_text|>"
    assert _render(name, CHAT, bos) == (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nHi<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n<think>hmm</think>Hello!<|eot|>"
        "<|header_start|>user<|header_end|>\n\nWeather?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n"
    )
    call = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}
    tool_chat = [
        TOOL_CHAT[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        TOOL_CHAT[2],
    ]
    assert _render(name, tool_chat, bos) == (
        "<|begin_of_text|><|header_start|>user<|header_end|>\n\nWeather in Paris?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n<|python_start|><|python_end|>"
        '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}<|eot|>'
        '<|header_start|>ipython<|header_end|>\n\n"sunny"<|eot|>'
        "<|header_start|>assistant<|header_end|>\n\n"
    )  # the template tojson's a string tool result and string arguments, quotes included


def test_qwen35() -> None:
    name = "Qwen3.5-4B.jinja"
    assert _render(name, CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert _render(name, CHAT, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert _render(name, TOOL_CHAT) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
        "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def _harmony_system(effort: str) -> str:
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message."
    )


def test_gpt_oss_harmony() -> None:
    name = "openai-gpt-oss-120b.jinja"
    chat = [
        *CHAT[:2],
        {"role": "assistant", "content": "Hello!", "reasoning_content": "hmm"},
        CHAT[3],
    ]
    assert (
        _render(name, chat, reasoning_effort="high")
        == (
            _harmony_system("high") + "<|end|>"
            "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
            "<|start|>user<|message|>Hi<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"  # past reasoning dropped
            "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
        )
    )
    assert "Reasoning: medium" in _render(name, chat)  # the template's default effort
    tool_chat = [
        *TOOL_CHAT[:1],
        {**TOOL_CHAT[1], "reasoning_content": "Need weather."},
        TOOL_CHAT[2],
    ]
    assert _render(name, tool_chat, tools=[TOOL]) == (
        _harmony_system("medium") + "\nCalls to these tools must go to the commentary channel: "
        "'functions'.<|end|><|start|>developer<|message|># Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Weather of a city\ntype get_weather = (_: {\ncity: string,\n"
        "}) => any;\n\n} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"
    )


def test_templates_stay_sandboxed() -> None:
    evil = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(ModelError, match="may not be '_x'"):
        ChatTemplate(evil).render([{"role": "user", "content": "hi"}])
    mutate = "{% set m = messages[0] %}{{ m.update({'role': 'x'}) }}"
    with pytest.raises(ModelError, match="refused"):
        ChatTemplate(mutate).render([{"role": "user", "content": "hi"}])
    loops = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert ChatTemplate(loops).render([{"role": "a"}, {"role": "b"}]) == "a"
