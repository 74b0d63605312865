"""A request's prompt as the coordinator computes it, shared with the gateway (which counts
it): given token ids, encoded text, or a chat rendered by the model's chat template with the
request's tools.

Messages go to the template as transformers hands them over: an assistant's `tool_calls`
with their arguments as objects (templates iterate them), a `tool` message's
`tool_call_id` and `name`.
"""

from __future__ import annotations

import json
from typing import Any

from kvq import wire
from kvq.text.tool_calls import arguments_as_text, tool_format


def template_messages(
    messages: list[wire.ChatMessage], args_as_text: bool = False
) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (`args_as_text`: a call's arguments as
    JSON text, for templates that join them as a string)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = json.loads(m.tool_calls)
            for c in d["tool_calls"] if args_as_text else []:
                if not isinstance(c["function"].get("arguments"), str):
                    c["function"]["arguments"] = json.dumps(c["function"].get("arguments"))
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def render_chat(chat: Any, messages: list[wire.ChatMessage], tools: str | None) -> str:
    """The chat's prompt text, BOS left out when the template wrote it (encoding adds it);
    ModelError when the template refuses it."""
    extra = {"tools": json.loads(tools)} if tools else {}
    as_text = arguments_as_text(tool_format(getattr(chat, "source", "")))
    text: str = chat.render(template_messages(messages, as_text), **extra)
    bos = chat.bos_token
    if bos and text.startswith(bos):
        text = text[len(bos) :]
    return text
