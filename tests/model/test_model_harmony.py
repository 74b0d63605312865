"""The harmony (gpt-oss) output parser: channels to content / reasoning_content / tool calls."""

from __future__ import annotations

import pytest

from kvq.text.harmony import HarmonyStream, Parsed, ToolCall, is_harmony, parse

ANSWER = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)
TOOL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)


def test_final_and_analysis_channels() -> None:
    assert parse(ANSWER) == Parsed("Hello! How can I help?", "The user greets; answer briefly.")
    assert parse(ANSWER + "<|return|>").content == "Hello! How can I help?"


def test_cut_short_and_unframed_text() -> None:
    assert parse("<|channel|>analysis<|message|>Thinking about") == Parsed("", "Thinking about")
    assert parse("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan") == Parsed(
        "", "a"
    )  # a header still arriving adds nothing
    assert parse("plain text, no channels") == Parsed("plain text, no channels")
    assert parse("<|channel|>final<|message|>only final") == Parsed("only final")


def test_several_analysis_messages_and_a_preamble() -> None:
    text = (
        "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>two<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done."
    )
    assert parse(text) == Parsed("Checking.Done.", "one\ntwo")


def test_tool_calls() -> None:
    assert parse(TOOL) == Parsed(
        "", "Need the weather.", [ToolCall("get_weather", '{"city": "Paris"}')]
    )
    header_last = "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}"
    assert parse(header_last).tool_calls == [ToolCall("lookup", "{}")]


def test_is_harmony() -> None:
    assert is_harmony(ANSWER) and is_harmony("<|channel|>")
    assert not is_harmony("Hello <|channel|>") and not is_harmony("")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_gives_the_same_split(step: int) -> None:
    for text in (ANSWER, TOOL, "<|channel|>final<|message|>a <| b <|end|>"):
        stream = HarmonyStream()
        parts = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
        parts.append(stream.finish())
        whole = parse(text)
        assert "".join(r for r, _ in parts) == (whole.reasoning_content or "")
        assert "".join(c for _, c in parts) == whole.content
        if "<| b" not in text:  # no marker leaks, even cut in two
            assert not any("<|" in r + c for r, c in parts)
