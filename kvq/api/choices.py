"""Calls that are more than one sequence, or whose text needs work after the last token:
several prompts, `n` > 1 and `best_of` (each choice its own request, so the coordinators
batch them like any others: never one after another), `echo` with the prompt's
log-probabilities, and a chat's tool calls read back from its text.

`fan_out` makes one call per sequence; `Choices` collects their answers into OpenAI's one
answer: the choices in order (prompt by prompt, `n` each), usage summed over all sequences
(`best_of` ones included, as OpenAI counts them).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import msgspec

from kvq import wire
from kvq.api.params import Call
from kvq.api.shape import Answer
from kvq.text import tool_calls


def fan_out(call: Call) -> list[Call]:
    """One call per sequence: each prompt, `best_of` times (`n` for a chat); choice k of a
    seeded call is sampled with seed + k, so the whole answer is reproducible."""
    s = call.sampling
    if call.best_of > call.n and s.logprobs is None:  # ranking needs the tokens' logprobs
        s = msgspec.structs.replace(s, logprobs=0)
    if call.echo or call.prompt_logprobs is not None:  # the prompt's tokens, their logprobs
        k = max(s.logprobs or 0, call.prompt_logprobs or 0)
        s = msgspec.structs.replace(s, prompt_logprobs=k)
    max_tokens = max(1, call.max_tokens)  # echo with max_tokens 0: one token, dropped
    prompts = call.prompts or ((call.prompt, call.prompt_ids),)
    out = []
    for prompt, ids in prompts:
        for k in range(call.best_of):
            seed = s.seed + k if s.seed is not None else None
            out.append(
                dataclasses.replace(
                    call,
                    prompt=prompt,
                    prompt_ids=ids,
                    max_tokens=max_tokens,
                    sampling=msgspec.structs.replace(s, seed=seed),
                )
            )
    return out


def _score(a: Answer) -> float:
    return sum(ev.logprob.logprob for ev in a.lp if ev.logprob is not None)


class Choices:
    """The answers of one call's sequences, and the one answer they make."""

    def __init__(self, call: Call, answers: list[Answer], tool_format: str = "hermes") -> None:
        self.call, self.answers, self.fmt = call, answers, tool_format
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.answers) if self.call.max_tokens else 0

    @property
    def prompt_tokens(self) -> int:
        """Each prompt once (its `best_of` sequences read it together)."""
        return sum(a.prompt_tokens for a in self.answers[:: self.call.best_of])

    def chosen(self) -> list[Answer]:
        """`n` answers per prompt: the best `n` of its `best_of` by total logprob."""
        per, n = self.call.best_of, self.call.n
        out = []
        for i in range(0, len(self.answers), per):
            group = self.answers[i : i + per]
            out += sorted(group, key=_score, reverse=True)[:n] if per > n else group
        return out

    def whole(self) -> dict[str, Any]:
        choices = [self._choice(a, i) for i, a in enumerate(self.chosen())]
        prompt, done = self.prompt_tokens, self.tokens
        head = self.answers[0].whole()
        usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if self.call.prompt_logprobs is not None and self.call.chat:  # vLLM's place for a chat
            head["prompt_logprobs"] = self._prompt_logprobs(self.answers[0])
        return head | {"id": self.id, "choices": choices, "usage": usage}

    def _choice(self, a: Answer, index: int) -> dict[str, Any]:
        choice: dict[str, Any] = a.whole()["choices"][0] | {"index": index}
        if not self.call.user_logprobs or self.call.sampling.logprobs is None:
            choice["logprobs"] = None
        if self.call.echo:
            self._echo(a, choice)
        if self.call.tools is not None:
            self._tools(choice)
        if self.call.prompt_logprobs is not None and not self.call.chat:
            choice["prompt_logprobs"] = self._prompt_logprobs(a)
        return choice

    def _prompt_logprobs(self, a: Answer) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first), the token and the
        `prompt_logprobs` likeliest there, by id: logprob, rank (1 = likeliest; None for the
        prompt token when it is not among those, as kvq ranks no further) and text."""
        k = self.call.prompt_logprobs or 0
        out: list[dict[str, dict[str, Any]] | None] = []
        for p in a.prompt or []:
            if p.logprob is None:
                out.append(None)
                continue
            top = p.top[:k]
            entry = {
                str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.text}
                for r, t in enumerate(top, 1)
            }
            rank = next((r for r, t in enumerate(top, 1) if t.token_id == p.token_id), None)
            entry[str(p.token_id)] = {"logprob": p.logprob, "rank": rank, "decoded_token": p.text}
            out.append(entry)
        return out

    def _echo(self, a: Answer, choice: dict[str, Any]) -> None:
        """The prompt before the text; its tokens' logprobs before the text's (OpenAI's
        completions shape: the first prompt token has None)."""
        prompt = a.prompt or []
        text = self.call.prompt if self.call.prompt is not None else "".join(p.text for p in prompt)
        if not self.call.max_tokens:  # max_tokens 0: the prompt alone
            choice["text"], choice["finish_reason"] = text, "length"
            a.lp = []
        else:
            choice["text"] = text + choice["text"]
        if self.call.sampling.logprobs is None:
            return
        gen = a._logprobs(a.lp, len(text)) if a.lp else {}
        offsets, at = [], 0
        for p in prompt:
            offsets.append(at)
            at += len(p.text)
        choice["logprobs"] = {
            "tokens": [p.text for p in prompt] + gen.get("tokens", []),
            "token_logprobs": [p.logprob for p in prompt] + gen.get("token_logprobs", []),
            "top_logprobs": [_top(p) for p in prompt] + gen.get("top_logprobs", []),
            "text_offset": offsets + gen.get("text_offset", []),
        }

    def _tools(self, choice: dict[str, Any]) -> None:
        msg = choice["message"]
        content, calls = tool_calls.parse(self.fmt, msg.get("content") or "")
        if not calls:
            return
        msg["content"] = content or None
        msg["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        choice["finish_reason"] = "tool_calls"


def _top(p: wire.PromptToken) -> dict[str, float] | None:
    if p.logprob is None:
        return None
    return {t.text: t.logprob for t in p.top} | {p.text: p.logprob}


def stream_chunks(whole: dict[str, Any], chat: bool, include_usage: bool) -> list[dict[str, Any]]:
    """A finished answer as stream chunks: per choice its role, its text (or tool calls) and
    its finish; then the usage chunk when asked."""
    head = {k: whole[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for c in whole["choices"]:
        i, finish = c["index"], c["finish_reason"]
        if not chat:
            out.append(
                head
                | {
                    "choices": [
                        {
                            "index": i,
                            "text": c["text"],
                            "logprobs": c["logprobs"],
                            "finish_reason": None,
                        }
                    ]
                }
            )
            out.append(
                head
                | {"choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": finish}]}
            )
            continue
        m = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
        if m.get("tool_calls"):
            delta["tool_calls"] = [t | {"index": j} for j, t in enumerate(m["tool_calls"])]
        out.append(
            head
            | {
                "choices": [
                    {"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
                ]
            }
        )
        out.append(
            head
            | {"choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}]}
        )
    if include_usage:
        out.append(head | {"choices": [], "usage": whole["usage"]})
    return out
