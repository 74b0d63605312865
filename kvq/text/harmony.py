"""GPT-OSS's harmony output split into what an OpenAI chat answer carries.

After the prompt's `<|start|>assistant`, a gpt-oss model writes messages such as

    <|channel|>analysis<|message|>The user wants...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris is sunny.

and a tool call as `<|start|>assistant to=functions.get_weather<|channel|>commentary json
<|message|>{"city": "Paris"}`. kvq's tokenizer keeps `<|start|>`, `<|channel|>`, `<|message|>`
and `<|end|>` in decoded text (as llama.cpp does; `<|return|>` and `<|call|>` end generation and
are dropped), so the text alone is enough. As vLLM does for gpt-oss: the `analysis` channel is
`reasoning_content`, the `final` channel is `content`, a `commentary` message addressed to a
tool is a tool call, and one addressed to no one (a preamble) is content. A message cut short
by the token limit counts with what it has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_MARKERS = (START, CHANNEL, MESSAGE, END, "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A message to a tool: `name` without harmony's `functions.` prefix, its raw arguments."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """An answer's parts; `reasoning_content` is None when the model wrote no analysis."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def is_harmony(text: str) -> bool:
    """Whether generated text is harmony framed: it opens with a channel header, as every
    gpt-oss answer does (its first token is `<|channel|>`)."""
    return text.lstrip().startswith(CHANNEL)


def parse(text: str) -> Parsed:
    """Split generated harmony text (what follows `<|start|>assistant`) into its parts."""
    if CHANNEL not in text and MESSAGE not in text:
        return Parsed(text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for chunk in text.split(START):
        header, sep, body = chunk.partition(MESSAGE)
        if not sep:
            continue  # a header still being written, or text between messages
        body = _until_end(body)
        found = _CHANNEL.search(header)
        channel = found.group(1) if found else ""
        to = _RECIPIENT.search(header)
        if to is not None:
            calls.append(ToolCall(to.group(1).removeprefix("functions."), body.strip()))
        elif channel == "analysis":
            reasoning.append(body)
        else:  # final, or a commentary preamble to the user
            content.append(body)
    return Parsed("".join(content), "\n".join(reasoning) if reasoning else None, calls)


def _until_end(body: str) -> str:
    cut = min((i for i in (body.find(m) for m in _MARKERS) if i >= 0), default=len(body))
    return body[:cut]


class HarmonyStream:
    """The same split for text that arrives piece by piece: `feed` returns the new
    (reasoning, content) text, holding back what may be the start of a marker."""

    def __init__(self) -> None:
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        safe = self.text
        for i in range(1, len("<|constrain|>")):  # a marker may be cut in two
            tail = safe[-i:]
            if any(m.startswith(tail) for m in (*_MARKERS, "<|constrain|>")):
                safe = safe[:-i]
                break
        return self._new(parse(safe))

    def finish(self) -> tuple[str, str]:
        """What is left once generation has ended."""
        return self._new(parse(self.text))

    def _new(self, p: Parsed) -> tuple[str, str]:
        reasoning = p.reasoning_content or ""
        r, c = reasoning[self._sent_reasoning :], p.content[self._sent_content :]
        self._sent_reasoning, self._sent_content = len(reasoning), len(p.content)
        return r, c
