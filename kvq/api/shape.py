"""OpenAI's response shapes: completions, chat completions, their stream chunks, usage and
logprobs, built from kvq reply events.

A chat answer that opens with a harmony channel header (gpt-oss: `kvq.text.harmony`) is split
as vLLM splits it: the final channel is `content`, the analysis channel `reasoning_content`,
streamed as deltas of each."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvq import wire
from kvq.text import harmony

# the coordinator's finish reasons, as OpenAI names them
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


@dataclass
class Answer:
    """What one call has produced so far."""

    request_id: str
    model: str
    chat: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    finish: str | None = None
    lp: list[wire.ReplyEvent] = field(default_factory=list)  # token events, when logprobs
    lp_offset: int = 0  # text offset of the next streamed token (completions' logprobs)
    channels: harmony.HarmonyStream | None = None  # set when a chat answer is harmony framed
    _framed: bool | None = None  # decided on the first text
    prompt: list[wire.PromptToken] | None = None  # the prompt's logprobs, when asked

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def add(self, ev: wire.ReplyEvent) -> str:
        """Take one event; the new text it makes final."""
        text = self._add(ev)
        if self.chat and self._framed is None and self.text:
            self._framed = harmony.is_harmony(self.text)
            self.channels = harmony.HarmonyStream() if self._framed else None
        return text

    def _add(self, ev: wire.ReplyEvent) -> str:
        if ev.kind == "token":
            self.tokens += 1
            self.text += ev.text
            if self.logprobs:
                self.lp.append(ev)
            return ev.text
        # done: the whole text; what the token events did not carry (held back) comes now
        tail = ev.text[len(self.text) :] if ev.text.startswith(self.text) else ""
        self.text, self.tokens = self.text + tail, ev.index
        self.prompt_tokens, self.finish = ev.prompt_tokens, FINISH.get(ev.finish or "", "stop")
        self.prompt = ev.prompt
        return tail

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            obj += ".chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish}
        if self.chat and self.channels is not None:
            parts = harmony.parse(self.text)
            choice["message"] = {"role": "assistant", "content": parts.content}
            if parts.reasoning_content is not None:
                choice["message"]["reasoning_content"] = parts.reasoning_content
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice["logprobs"] = self._logprobs(self.lp, 0) if self.logprobs else None
        return self._head(False) | {"choices": [choice], "usage": self.usage()}

    def chunk(
        self,
        text: str,
        events: list[wire.ReplyEvent],
        finish: str | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        """One streamed chunk: new text (and its tokens' logprobs), or the finish."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            reasoning, text = self._channels(text, finish is not None)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or (first and not finish):
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        if self.logprobs and events:
            choice["logprobs"] = self._logprobs(events, self.lp_offset)
            self.lp_offset += sum(len(_tok(e)) for e in events)
        choice["finish_reason"] = finish
        return self._head(True) | {"choices": [choice]}

    def _channels(self, text: str, end: bool) -> tuple[str, str]:
        """(reasoning, content) of new text: all content unless the answer is harmony."""
        if self.channels is None:
            return "", text
        reasoning, content = self.channels.feed(text)
        if end:
            more_reasoning, more_content = self.channels.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def usage_chunk(self) -> dict[str, Any]:
        return self._head(True) | {"choices": [], "usage": self.usage()}

    def _logprobs(self, events: list[wire.ReplyEvent], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [_chat_lp(ev) for ev in events]}
        offsets = []
        for ev in events:
            offsets.append(offset)
            offset += len(_tok(ev))
        return {
            "tokens": [_tok(ev) for ev in events],
            "token_logprobs": [ev.logprob.logprob if ev.logprob else None for ev in events],
            "top_logprobs": [{t.text: t.logprob for t in ev.top_logprobs or []} for ev in events],
            "text_offset": offsets,
        }


def _tok(ev: wire.ReplyEvent) -> str:
    """A token's own text (its event's `text` may be held back or cover several tokens)."""
    return ev.logprob.text if ev.logprob is not None else ev.text


def _chat_lp(ev: wire.ReplyEvent) -> dict[str, Any]:
    tok = _tok(ev)
    return {
        "token": tok,
        "logprob": ev.logprob.logprob if ev.logprob else None,
        "bytes": list(tok.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
            for t in ev.top_logprobs or []
        ],
    }


def model_card(model: str, created: int, context_length: int) -> dict[str, Any]:
    """One model object: OpenAI's fields, and its context length as vLLM (`max_model_len`)
    and llama.cpp's server (`context_length`) name it."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "kvq",
        "max_model_len": context_length,
        "context_length": context_length,
    }


def models_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
