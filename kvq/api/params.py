"""OpenAI request bodies → a checked `Call`, or a 400 naming the parameter.

Everything is checked here, before anything is queued. Parameters kvq does not use (`user`,
`logit_bias` when empty, ...) are accepted and ignored, as OpenAI-compatible servers do;
parameters that would change the answer and that kvq cannot honour (`n` > 1, `echo`,
`suffix`, tools, a non-empty `logit_bias`) are refused rather than silently dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from kvq import wire
from kvq.api.limits import MAX_TEMPERATURE
from kvq.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
REFUSED = ("suffix", "tools", "functions", "tool_choice", "function_call", "response_format")


@dataclass(frozen=True, slots=True)
class Call:
    """One checked completion or chat completion call."""

    chat: bool
    model: str
    max_tokens: int
    sampling: wire.SamplingParams
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[wire.ChatMessage] | None = None
    max_tokens_given: bool = True  # False: a chat's default, the room left in the context


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


MAX_DEPTH = 32  # nesting of a body's arrays and objects; OpenAI's deepest is about 6
MAX_INT = 2**63 - 1  # any integer a body may hold (ids, seeds, counts) fits int64


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 (param `body`): not JSON, not an object, nested
    deeper than MAX_DEPTH, a string that is not Unicode (a lone surrogate such as
    "\\ud800"), or an integer beyond int64. Every later read can then trust the types."""
    try:
        d = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad("body", f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise _bad("body", f"the body is nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(d, dict):
        raise _bad("body", "the body must be a JSON object")
    _check_values(d)
    return d


def _check_values(root: Any) -> None:
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise _bad("body", f"the body is nested deeper than {MAX_DEPTH} levels")
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad("body", "the body holds a string that is not valid Unicode (a lone "
                           "surrogate escape such as \\ud800)") from None  # fmt: skip
        elif isinstance(v, int) and not isinstance(v, bool) and not -MAX_INT <= v <= MAX_INT:
            raise _bad("body", f"the body holds an integer beyond 64 bits: {str(v)[:40]}")


class _Body:
    """Typed reads of a JSON object's fields, each refusing with the field's name."""

    def __init__(self, raw: bytes) -> None:
        self.d: dict[str, Any] = json_object(raw)

    def get(self, name: str) -> Any:
        v = self.d.get(name)
        return None if v is None else v

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        v = self.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise _bad(name, f"'{name}' must be a number, got {v!r}")
        if not lo <= v <= hi:
            raise _bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
        return float(v)

    def integer(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        v = self.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(name, f"'{name}' must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise _bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
        return v

    def flag(self, name: str, default: bool) -> bool:
        v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(name, f"'{name}' must be true or false, got {v!r}")
        return v


def parse(raw: bytes, *, chat: bool, max_tokens_default: int, max_tokens_limit: int) -> Call:
    """The call a body asks for; ApiError 400 for the first bad parameter."""
    b = _Body(raw)
    model = b.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= 512:
        raise _bad("model", f"'model' must be a model id, got {model!r}")
    for name in REFUSED:
        if b.get(name) not in (None, [], "", {"type": "text"}):  # plain text is what kvq gives
            raise _bad(name, f"'{name}' is not supported by kvq")
    if b.get("logit_bias") not in (None, {}):  # empty: what some clients always send
        raise _bad("logit_bias", "'logit_bias' is not supported by kvq")
    b.integer("n", 1, 1, 1)  # one choice per call
    b.integer("best_of", 1, 1, 1)
    if b.flag("echo", False):
        raise _bad("echo", "'echo' is not supported by kvq")
    limit = "max_completion_tokens" if chat and b.get("max_completion_tokens") else "max_tokens"
    max_tokens = b.integer(limit, max_tokens_default, 1, max_tokens_limit)
    assert max_tokens is not None
    given = b.get(limit) is not None
    stream = b.flag("stream", False)
    options = b.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options", "'stream_options' must be an object, with 'stream': true")
    include_usage = bool(options and options.get("include_usage"))
    sampling = _sampling(b, chat)
    common = {"chat": chat, "model": model, "max_tokens": max_tokens, "sampling": sampling,
              "stream": stream, "include_usage": include_usage,
              "max_tokens_given": given}  # fmt: skip
    if chat:
        return Call(messages=_messages(b.get("messages")), **common)  # type: ignore[arg-type]
    prompt, ids = _prompt(b.get("prompt"))
    return Call(prompt=prompt, prompt_ids=ids, **common)  # type: ignore[arg-type]


def _sampling(b: _Body, chat: bool) -> wire.SamplingParams:
    stop = b.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (
        not isinstance(stops, list)
        or len(stops) > wire.MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stops)
    ):
        raise _bad("stop", f"'stop' must be a string or up to {wire.MAX_STOPS} non-empty strings")
    ids = b.get("stop_token_ids")
    if ids is not None and (
        not isinstance(ids, list)
        or len(ids) > 64
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise _bad("stop_token_ids", "'stop_token_ids' must be up to 64 token ids (integers >= 0)")
    top_k = b.integer("top_k", 0, -1, 1 << 20)  # vLLM's extension; -1 = no limit, as 0
    logprobs = _logprobs(b, chat)
    try:
        return wire.SamplingParams(
            temperature=b.number("temperature", 1.0, 0.0, MAX_TEMPERATURE),
            top_p=_top_p(b), top_k=max(0, top_k or 0),
            seed=b.integer("seed", None, -(1 << 63), (1 << 64) - 1),
            stop=list(stops or []), stop_token_ids=list(ids or []),
            presence_penalty=b.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=b.number("frequency_penalty", 0.0, -2.0, 2.0),
            logprobs=logprobs,
        )  # fmt: skip
    except msgspec.ValidationError as exc:  # a range the checks above missed
        raise _bad("body", str(exc)) from None


def _top_p(b: _Body) -> float:
    v = b.number("top_p", 1.0, 0.0, 1.0)
    if v <= 0:
        raise _bad("top_p", "'top_p' must be in (0, 1]")
    return v


def _logprobs(b: _Body, chat: bool) -> int | None:
    """How many alternatives per token to report, or None for no logprobs at all."""
    top = wire.MAX_TOP_LOGPROBS
    if not chat:  # completions: `logprobs` is the number of alternatives
        return b.integer("logprobs", None, 0, top)
    if not b.flag("logprobs", False):
        if b.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return b.integer("top_logprobs", 0, 0, top)


def _prompt(p: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        if any(i < 0 for i in p):
            raise _bad("prompt", "token ids in 'prompt' must be >= 0")
        return None, p
    raise _bad("prompt", "'prompt' must be a string or a list of token ids (one prompt)")


def parse_messages(ms: Any) -> list[wire.ChatMessage]:
    """A chat's `messages`, checked; 400 naming the bad one."""
    return _messages(ms)


def _messages(ms: Any) -> list[wire.ChatMessage]:
    if not isinstance(ms, list) or not ms:
        raise _bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a 'role'")
        if m["role"] not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                       f"{', '.join(ROLES)}, got {m['role'][:64]!r}")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append(wire.ChatMessage(role=m["role"][:64], content=content))
    return out
