"""The parameters that shape what a call may generate, checked (400 naming the parameter):
OpenAI's `response_format` (`json_object`, `json_schema` with `strict`), llama-server's
`grammar` (GBNF or Lark) and `json_schema`, vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, OpenAI's `logit_bias`, and `tools` with `tool_choice`.

A grammar is compiled here (`kvq.text.grammar`), so a bad schema is refused before anything
is queued; the coordinator masks the logits with it at every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvq import wire
from kvq.errors import ApiError, ModelError

ANY_OBJECT = '{"type": "object"}'


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def constraint(d: dict[str, Any]) -> tuple[str, str, str] | None:
    """(param, kind, text) of the one grammar the body asks for, or None; 400 for two."""
    found = [c for c in (_response_format(d.get("response_format")), *_extras(d)) if c]
    if len(found) > 1:
        raise _bad(
            found[1][0], f"'{found[0][0]}' and '{found[1][0]}' both constrain the answer; give one"
        )
    return found[0] if found else None


def _response_format(rf: Any) -> tuple[str, str, str] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad(
            "response_format",
            '\'response_format\' must be {"type": "text"}, '
            '{"type": "json_object"} or {"type": "json_schema", "json_schema": '
            '{"name", "schema", "strict"}}',
        )
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return ("response_format", "json_schema", ANY_OBJECT)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise _bad(
            "response_format.json_schema",
            "'response_format.json_schema' must be an object with a 'schema' object",
        )
    schema = js.get("schema") or {"type": "object"}
    return ("response_format.json_schema", "json_schema", json.dumps(schema))


def _extras(d: dict[str, Any]) -> list[tuple[str, str, str] | None]:
    out: list[tuple[str, str, str] | None] = []
    for name, kind in (("grammar", "gbnf"), ("guided_grammar", "gbnf"), ("guided_regex", "regex")):
        v = d.get(name)
        if v is not None:
            if not isinstance(v, str) or not v.strip():
                raise _bad(name, f"'{name}' must be a non-empty string")
            out.append((name, kind, v))
    for name in ("json_schema", "guided_json"):
        v = d.get(name)
        if v is not None:
            if isinstance(v, str):
                v = _json(name, v)
            if not isinstance(v, dict):
                raise _bad(name, f"'{name}' must be a JSON schema (an object)")
            out.append((name, "json_schema", json.dumps(v)))
    v = d.get("guided_choice")
    if v is not None:
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise _bad("guided_choice", "'guided_choice' must be a non-empty list of strings")
        out.append(("guided_choice", "choice", json.dumps(v)))
    return out


def _json(param: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise _bad(param, f"'{param}' is not valid JSON") from None


def compile_constraint(c: tuple[str, str, str]) -> str:
    """llguidance's grammar for (param, kind, text); 400 naming the param when it is bad,
    501 when llguidance is not installed here."""
    from kvq.text import grammar

    param, kind, text = c
    if not grammar.available():
        raise ApiError(
            501,
            f"'{param}' needs constrained decoding: this gateway has no "
            "llguidance (pip install 'kvq[grammar]')",
            param=param,
            kind="server_error",
            code="no_grammar",
        )
    try:
        return grammar.compile_grammar(kind, text)
    except ModelError as exc:
        raise _bad(param, f"'{param}': {exc}") from None


def logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's `logit_bias`: token id (a string key) → a bias in [-100, 100]."""
    if v is None or v == {}:
        return {}
    if not isinstance(v, dict) or len(v) > wire.MAX_LOGIT_BIAS:
        raise _bad(
            "logit_bias", f"'logit_bias' must map up to {wire.MAX_LOGIT_BIAS} token ids to biases"
        )
    out = {}
    for k, b in v.items():
        if not str(k).isdigit() or len(str(k)) > 10:
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids, got {str(k)[:20]!r}")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"'logit_bias' values must be in [-100, 100], got {b!r}")
        out[int(k)] = float(b)
    return out


@dataclass(frozen=True, slots=True)
class Tools:
    """A chat's tools (OpenAI's list, as JSON text for the template) and which it must call:
    `choice` is "auto", "required" or a function's name."""

    spec: list[dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def json(self) -> str:
        return json.dumps(self.spec)

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.spec if t["function"]["name"] == name)


def tools(d: dict[str, Any]) -> Tools | None:
    """The chat's tools, or None (no tools, or `tool_choice: "none"`)."""
    spec, choice = d.get("tools"), d.get("tool_choice")
    if spec in (None, []):
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(spec, list) or len(spec) > 128:
        raise _bad(
            "tools",
            '\'tools\' must be a list of up to 128 {"type": "function", '
            '"function": {"name", "parameters"}} objects',
        )
    names = []
    for i, t in enumerate(spec):
        f = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(f, dict)
            or t.get("type", "function") != "function"
            or not (isinstance(f.get("name"), str) and 0 < len(f["name"]) <= 64)
        ):
            raise _bad(
                f"tools[{i}]",
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters"}}}}',
            )
        f.setdefault("description", "")  # optional in OpenAI's API; templates print it
        if not isinstance(f.setdefault("parameters", {"type": "object"}), dict):
            raise _bad(f"tools[{i}].function.parameters", "parameters must be a JSON schema")
        names.append(f["name"])
    name = _choice(choice, names)
    if name == "none":
        return None
    parallel = d.get("parallel_tool_calls", True) is not False
    return Tools([{"type": "function", "function": t["function"]} for t in spec], name, parallel)


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None or choice in ("auto", "none", "required"):
        return str(choice or "auto")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return str(name)
        raise _bad("tool_choice", f"'tool_choice' names {str(name)[:64]!r}, not one of the tools")
    raise _bad(
        "tool_choice",
        "'tool_choice' must be none, auto, required or "
        '{"type": "function", "function": {"name"}}',
    )
