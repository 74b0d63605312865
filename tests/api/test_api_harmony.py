"""Chat answers in harmony framing (gpt-oss): the final channel is `content`, the analysis
channel `reasoning_content`, whole and streamed, from a fake model's reply events."""

from __future__ import annotations

from typing import Any

from kvq import wire
from kvq.api.shape import Answer

TOKENS = [
    "<|channel|>",
    "analysis",
    "<|message|>",
    "User",
    " says",
    " hi",
    ".",
    "<|end|>",
    "<|start|>",
    "assistant",
    "<|channel|>",
    "final",
    "<|message|>",
    "Hello",
    "!",
]
WHOLE = "".join(TOKENS)


def _events() -> list[wire.ReplyEvent]:
    evs = [wire.ReplyEvent(kind="token", index=i, text=t) for i, t in enumerate(TOKENS)]
    done = wire.ReplyEvent(kind="done", index=len(TOKENS), text=WHOLE, finish="eos")
    return [*evs, done]


def test_whole_answer_splits_the_channels() -> None:
    answer = Answer("r1", "gpt-oss", chat=True, logprobs=False)
    for ev in _events():
        answer.add(ev)
    message = answer.whole()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "User says hi.",
    }


def test_stream_sends_reasoning_then_content() -> None:
    answer = Answer("r2", "gpt-oss", chat=True, logprobs=False)
    deltas: list[dict[str, Any]] = [answer.chunk("", [], first=True)["choices"][0]["delta"]]
    for ev in _events():  # as kvq api's stream loop calls them
        text = answer.add(ev)
        if ev.kind == "token":
            deltas.append(answer.chunk(text, [])["choices"][0]["delta"])
        else:
            deltas.append(answer.chunk(text, [], finish=answer.finish)["choices"][0]["delta"])
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "User says hi."
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert not any("<|" in str(d) for d in deltas)


def test_other_answers_are_untouched() -> None:
    answer = Answer("r3", "qwen", chat=True, logprobs=False)
    for ev in (
        wire.ReplyEvent(kind="token", text="Hi <|channel|>"),
        wire.ReplyEvent(kind="done", index=1, text="Hi <|channel|>", finish="eos"),
    ):
        answer.add(ev)
    assert answer.whole()["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hi <|channel|>",
    }
    completion = Answer("r4", "gpt-oss", chat=False, logprobs=False)
    for ev in _events():
        completion.add(ev)
    assert completion.whole()["choices"][0]["text"] == WHOLE  # completions stay raw text
