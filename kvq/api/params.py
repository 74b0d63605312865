"""OpenAI request bodies → a checked `Call`, or a 400 naming the parameter.

Everything is checked here, before anything is queued. Parameters kvq does not use (`user`,
...) are accepted and ignored, as OpenAI-compatible servers do; parameters that would change
the answer and that kvq cannot honour (`suffix`, the legacy `functions`) are refused rather
than silently dropped. The grammar, tool and choice parameters: `kvq.api.structured`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from kvq import wire
from kvq.api import structured
from kvq.api.limits import MAX_TEMPERATURE
from kvq.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
REFUSED = ("suffix", "functions", "function_call")
MAX_CHOICES = 16  # `n`, `best_of`, and prompts x choices of one call


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
    prompts: tuple[tuple[str | None, list[int] | None], ...] = ()  # completions: all of them
    n: int = 1
    best_of: int = 1
    echo: bool = False  # completions: the prompt (and its logprobs) before the text
    tools: structured.Tools | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, top k each
    user_logprobs: bool = True  # False: logprobs asked only to rank `best_of`

    @property
    def tools_json(self) -> str | None:
        return self.tools.json if self.tools is not None else None

    @property
    def simple(self) -> bool:
        """One prompt, one choice, nothing to add to the text: the streamed path as is."""
        return (
            len(self.prompts) <= 1
            and self.best_of == 1
            and not self.echo
            and not self.tools
            and self.prompt_logprobs is None
        )


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
                raise _bad(
                    "body",
                    "the body holds a string that is not valid Unicode (a lone "
                    "surrogate escape such as \\ud800)",
                ) from None
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
    n = b.integer("n", 1, 1, MAX_CHOICES) or 1
    best_of = (b.integer("best_of", n, n, MAX_CHOICES) or n) if not chat else n
    echo = not chat and b.flag("echo", False)
    limit = "max_completion_tokens" if chat and b.get("max_completion_tokens") else "max_tokens"
    max_tokens = b.integer(limit, max_tokens_default, 0 if echo else 1, max_tokens_limit)
    assert max_tokens is not None
    given = b.get(limit) is not None
    stream = b.flag("stream", False)
    options = b.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options", "'stream_options' must be an object, with 'stream': true")
    include_usage = bool(options and options.get("include_usage"))
    sampling = _sampling(b, chat)
    common = {
        "chat": chat,
        "model": model,
        "max_tokens": max_tokens,
        "sampling": sampling,
        "stream": stream,
        "include_usage": include_usage,
        "max_tokens_given": given,
    }
    extra = _extra(b, chat, n, best_of, echo)
    if chat:
        return Call(messages=_messages(b.get("messages")), **common, **extra)  # type: ignore[arg-type]
    prompts = _prompts(b.get("prompt"))
    if len(prompts) * best_of > MAX_CHOICES:
        raise _bad("prompt", f"prompts x best_of (or n) must be at most {MAX_CHOICES}")
    prompt, ids = prompts[0]
    return Call(prompt=prompt, prompt_ids=ids, prompts=prompts, **common, **extra)  # type: ignore[arg-type]


def _extra(b: _Body, chat: bool, n: int, best_of: int, echo: bool) -> dict[str, Any]:
    """What the sequence's sampling does not say: choices, echo, tools."""
    tools = structured.tools(b.d) if chat else None
    if b.get("tools") is not None and not chat:
        raise _bad("tools", "'tools' is for /v1/chat/completions")
    prompt_lp = b.integer("prompt_logprobs", None, 0, wire.MAX_TOP_LOGPROBS)
    return {"n": n, "best_of": best_of, "echo": echo, "tools": tools, "prompt_logprobs": prompt_lp}


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
            top_p=_top_p(b),
            top_k=max(0, top_k or 0),
            seed=b.integer("seed", None, -(1 << 63), (1 << 64) - 1),
            stop=list(stops or []),
            stop_token_ids=list(ids or []),
            presence_penalty=b.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=b.number("frequency_penalty", 0.0, -2.0, 2.0),
            logprobs=logprobs,
            logit_bias=structured.logit_bias(b.get("logit_bias")),
            grammar=_grammar(b),
            draft_max=b.integer("speculative.n_max", None, 0, wire.MAX_DRAFT_TOKENS),
        )
    except msgspec.ValidationError as exc:  # a range the checks above missed
        raise _bad("body", str(exc)) from None


def _grammar(b: _Body) -> str | None:
    c = structured.constraint(b.d)
    return structured.compile_constraint(c) if c is not None else None


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


def _prompts(p: Any) -> tuple[tuple[str | None, list[int] | None], ...]:
    """Every prompt of a completion call: a string, token ids, or a list of either."""
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        return tuple(_prompt(x) for x in p)
    return (_prompt(p),)


def _prompt(p: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        if any(i < 0 for i in p):
            raise _bad("prompt", "token ids in 'prompt' must be >= 0")
        return None, p
    raise _bad("prompt", "'prompt' must be a string, a list of token ids, or a list of those")


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
            raise _bad(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role'][:64]!r}",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append(wire.ChatMessage(role=m["role"][:64], content=content, **_tool_fields(i, m)))
    return out


def _tool_fields(i: int, m: dict[str, Any]) -> dict[str, Any]:
    """An assistant's `tool_calls` (arguments as objects, as templates read them), a tool
    message's `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
        ):
            raise _bad(
                f"messages[{i}].tool_calls",
                "tool_calls must be a list of "
                '{"id", "type": "function", "function": {"name", "arguments"}}',
            )
        out["tool_calls"] = json.dumps([_call_args(c) for c in calls])
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key][:256]
    return out


def _call_args(c: dict[str, Any]) -> dict[str, Any]:
    f = dict(c["function"])
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            f["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # the template gets the text as it came
    return {"id": c.get("id"), "type": "function", "function": f}
