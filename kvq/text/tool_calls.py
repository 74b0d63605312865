"""Tool calls in each family's own format, as its chat template writes them: which format a
template uses (`tool_format`), a grammar that makes the model write one valid call
(`call_grammar`, for `tool_choice` required or named), and the calls read back from
generated text (`parse`).

| format | family | a call as the model writes it |
|---|---|---|
| `hermes` | Qwen3 (and the default) | `<tool_call>{"name": N, "arguments": {...}}</tool_call>` |
| `qwen-xml` | Qwen3.5 | `<tool_call><function=N><parameter=K>V</parameter></function></tool_call>` |
| `glm` | GLM-4.5/4.6 | `<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` |
| `deepseek-v3` | DeepSeek-V3 | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N` and the arguments in a json block |
| `deepseek-v3.1` | DeepSeek-V3.1 | `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` |
| `harmony` | gpt-oss | `<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}` |
| `llama4` | Llama-4 | `{"name": N, "parameters": {...}}` (after `<|python_start|>`) |
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvq.text import harmony
from kvq.text.grammar import COMPACT

_DS = "\uff5c"  # DeepSeek's full-width bar
_DS_SEP = "\u2581"
CALLS_BEGIN = f"<{_DS}tool{_DS_SEP}calls{_DS_SEP}begin{_DS}>"
CALL_BEGIN = f"<{_DS}tool{_DS_SEP}call{_DS_SEP}begin{_DS}>"
CALL_SEP = f"<{_DS}tool{_DS_SEP}sep{_DS}>"
CALL_END = f"<{_DS}tool{_DS_SEP}call{_DS_SEP}end{_DS}>"
CALLS_END = f"<{_DS}tool{_DS_SEP}calls{_DS_SEP}end{_DS}>"


@dataclass(frozen=True, slots=True)
class Call:
    """One call read back: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def tool_format(template: str) -> str:
    """The tool-call format a chat template writes (`hermes` when it shows none)."""
    if "<arg_key>" in template:
        return "glm"
    if "<function=" in template:
        return "qwen-xml"
    if CALL_SEP in template:
        return "deepseek-v3" if "```json" in template else "deepseek-v3.1"
    if "to=functions" in template or "<|channel|>" in template:
        return "harmony"
    if "<|python_start|>" in template:
        return "llama4"
    return "hermes"


def arguments_as_text(fmt: str) -> bool:
    """Whether the template joins a call's arguments as a string (else it reads an object)."""
    return fmt == "deepseek-v3"


def markers(fmt: str) -> tuple[str, ...]:
    """Texts that open a call in this format: content before them is the answer's text."""
    return {
        "glm": ("<tool_call>",),
        "qwen-xml": ("<tool_call>",),
        "hermes": ("<tool_call>",),
        "deepseek-v3": (CALLS_BEGIN, CALL_BEGIN),
        "deepseek-v3.1": (CALLS_BEGIN, CALL_BEGIN),
        "harmony": ("<|channel|>commentary to=functions.", " to=functions."),
        "llama4": ("<|python_start|>", '{"name"'),
    }[fmt]


def _lit(s: str) -> str:
    return json.dumps(s)


def _schema(params: dict[str, Any]) -> str:
    return json.dumps(strict(params))


def strict(params: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema as a call must meet it: no keys it does not name
    (unless it says otherwise), JSON without free whitespace."""
    out = dict(params or {"type": "object"})
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    out.setdefault("x-guidance", COMPACT)
    return out


def _one_call(fmt: str, name: str, params: dict[str, Any]) -> str:
    """The Lark expression of one call of `name` with arguments valid for `params`."""
    args = f"%json {_schema(params)}"
    if fmt == "hermes":
        wrapper = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": strict(params)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        wrapper["x-guidance"] = COMPACT
        return f'"<tool_call>\\n" %json {json.dumps(wrapper)} "\\n</tool_call>"'
    if fmt == "llama4":
        wrapper = {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": strict(params)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        wrapper["x-guidance"] = COMPACT
        return f"%json {json.dumps(wrapper)}"
    if fmt == "deepseek-v3":
        head = f"{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n"
        return f"{_lit(head)} {args} {_lit(chr(10) + '```' + CALL_END)}"
    if fmt == "deepseek-v3.1":
        return f"{_lit(CALL_BEGIN + name + CALL_SEP)} {args} {_lit(CALL_END)}"
    if fmt == "harmony":
        return f"{_lit(f'<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>')} {args}"
    return _xml_call(fmt, name, params)


def _xml_call(fmt: str, name: str, params: dict[str, Any]) -> str:
    """GLM's and Qwen3.5's calls: one element per argument (the required ones, in order), a
    string's value as plain text, any other as JSON."""
    props: dict[str, Any] = (params or {}).get("properties", {})
    parts = []
    for key in (params or {}).get("required", list(props)):
        sub = props.get(key, {})
        lo, hi = sub.get("minLength", 0), sub.get("maxLength", 64)
        text = "/[^<\\n]{" + f"{lo},{hi}" + "}/"  # a string's value is its plain text
        value = text if sub.get("type") == "string" else f"%json {_schema(sub)}"
        if fmt == "glm":
            parts.append(
                f"{_lit(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} "
                f"{value} {_lit('</arg_value>' + chr(10))}"
            )
        else:
            parts.append(
                f"{_lit(f'<parameter={key}>' + chr(10))} {value} "
                f"{_lit(chr(10) + '</parameter>' + chr(10))}"
            )
    if fmt == "glm":
        return " ".join([_lit(f"<tool_call>{name}\n"), *parts, _lit("</tool_call>")])
    head = _lit(f"<tool_call>\n<function={name}>\n")
    return " ".join([head, *parts, _lit("</function>\n</tool_call>")])


def call_grammar(fmt: str, functions: list[dict[str, Any]], parallel: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) of one call of one of `functions` (OpenAI's
    `function` objects: name, parameters), or one or more with `parallel`."""
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    rules = [
        f"call{i}: {_one_call(fmt, f['name'], f.get('parameters') or {})}"
        for i, f in enumerate(functions)
    ]
    sep = '"\\n"' if fmt != "deepseek-v3.1" else '""'
    start = f"start: one ({sep} one)*" if parallel and fmt != "harmony" else "start: one"
    head = _lit(CALLS_BEGIN) + " " if fmt.startswith("deepseek") else ""
    tail = " " + _lit(CALLS_END) if fmt.startswith("deepseek") else ""
    start = start.replace("start: ", f"start: {head}(") + f"){tail}" if head else start
    return "\n".join([start, f"one: {calls}", *rules])


def parse(fmt: str, text: str) -> tuple[str, list[Call]]:
    """(content, calls) of generated text: the text before the first call is content; a
    call that does not parse is left in the content."""
    if fmt == "harmony":
        got = harmony.parse(text)
        calls = [Call(c.name, c.arguments) for c in getattr(got, "tool_calls", []) or []]
        return (got.content or "") if calls else text, calls
    at = min((i for i in (text.find(m) for m in markers(fmt)) if i >= 0), default=-1)
    if at < 0:
        return text, []
    calls = _PARSERS[fmt](text[at:])
    return (text[:at].strip(), calls) if calls else (text, [])


def _json_calls(text: str, args_key: str) -> list[Call]:
    out = []
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = dec.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and args_key in obj:
            out.append(Call(obj["name"], json.dumps(obj[args_key])))
    return _outermost(out)


def _outermost(calls: list[Call]) -> list[Call]:
    return [c for c in calls if not any(c is not o and c.arguments in o.arguments for o in calls)]


def _hermes(text: str) -> list[Call]:
    out = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
        out += _json_calls(body, "arguments")[:1]
    return out


def _llama4(text: str) -> list[Call]:
    return _json_calls(text, "parameters")


def _deepseek(text: str) -> list[Call]:
    out = []
    for body in re.findall(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), text, re.S):
        left, _, right = body.partition(CALL_SEP)
        if "```" in right or left == "function":  # V3: function<sep>NAME, a json block
            name, _, right = right.partition("\n")
        else:  # V3.1: NAME<sep>{...}
            name = left
        args = right.strip().removeprefix("```json").removesuffix("```").strip()
        if name.strip() and _is_object(args):
            out.append(Call(name.strip(), json.dumps(json.loads(args))))
    return out


def _is_object(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


def _value(v: str) -> Any:
    v = v.strip("\n")
    try:
        return json.loads(v)
    except ValueError:
        return v


def _glm(text: str) -> list[Call]:
    out = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        name = body.split("<arg_key>")[0].strip()
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S)
        if name:
            out.append(Call(name, json.dumps({k.strip(): _value(v) for k, v in pairs})))
    return out


def _qwen_xml(text: str) -> list[Call]:
    out = []
    for name, body in re.findall(r"<function=([^>\n]+)>(.*?)</function>", text, re.S):
        pairs = re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", body, re.S)
        out.append(Call(name.strip(), json.dumps({k.strip(): _value(v) for k, v in pairs})))
    return out


_PARSERS = {
    "hermes": _hermes,
    "llama4": _llama4,
    "deepseek-v3": _deepseek,
    "deepseek-v3.1": _deepseek,
    "glm": _glm,
    "qwen-xml": _qwen_xml,
}
