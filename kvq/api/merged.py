"""Several choices streamed token by token: a call with `n` > 1 or a list of prompts whose
choices need nothing of the finished answer (no `best_of` ranking, `echo`, `prompt_logprobs`
or tool calls read back from the text). Each choice is its own request; their reply events are
merged as they come, and each chunk carries its choice's index, as OpenAI streams several
choices. The others are streamed as chunks of the finished answer (`choices.stream_chunks`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvq import wire
from kvq.api.choices import Choices
from kvq.api.params import Call
from kvq.api.shape import Answer

Events = AsyncIterator[wire.ReplyEvent]


def live(call: Call) -> bool:
    """Whether the call's choices stream token by token."""
    return (
        call.stream
        and call.best_of == call.n
        and not call.echo
        and call.tools is None
        and call.prompt_logprobs is None
    )


async def _then(first: wire.ReplyEvent, rest: Events) -> Events:
    yield first
    if first.kind != "done":
        async for ev in rest:
            yield ev


async def merge(events: list[Events]) -> AsyncIterator[tuple[int, wire.ReplyEvent]]:
    """(i, event) of each iterator `events[i]`, in the order they come."""
    waiting: dict[asyncio.Future[wire.ReplyEvent], int] = {}

    def ask(i: int) -> None:
        waiting[asyncio.ensure_future(anext(events[i]))] = i

    for i in range(len(events)):
        ask(i)
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(fut)
                try:
                    ev = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, ev
                if ev.kind != "done":
                    ask(i)
    finally:
        for fut in waiting:
            fut.cancel()


async def chunks(
    call: Call, answers: list[Answer], firsts: list[wire.ReplyEvent], events: list[Events]
) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks: a chat's role chunk per choice, then each choice's text (and its
    tokens' logprobs) as it comes, its finish, and the usage of all when asked."""
    head = answers[0]

    def indexed(chunk: dict[str, Any], i: int) -> dict[str, Any]:
        chunk["choices"][0]["index"] = i
        return chunk | {"id": head.id, "created": head.created}

    if call.chat:
        for i, a in enumerate(answers):
            yield indexed(a.chunk("", [], first=True), i)
    merged = merge([_then(f, e) for f, e in zip(firsts, events, strict=True)])
    async for i, ev in merged:
        a = answers[i]
        text = a.add(ev)
        if ev.kind == "token" and (text or a.logprobs):
            yield indexed(a.chunk(text, [ev] if a.logprobs else []), i)
        elif ev.kind == "done":
            if text:
                yield indexed(a.chunk(text, []), i)
            yield indexed(a.chunk("", [], finish=a.finish), i)
    if call.include_usage:
        c = Choices(call, answers)
        usage = {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.tokens,
            "total_tokens": c.prompt_tokens + c.tokens,
        }
        yield head.usage_chunk() | {"id": head.id, "usage": usage}
