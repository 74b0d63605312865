"""Chat templates: a model's `tokenizer.chat_template` rendered the way transformers does it.

The template is Jinja2 from the model file, so it is untrusted: it runs in an
`ImmutableSandboxedEnvironment` (no attribute access to internals, no mutation of the
arguments) with what transformers' `apply_chat_template` gives a template: `trim_blocks` and
`lstrip_blocks`, loop controls (`break`, `continue`), the `{% generation %}` block, the
`raise_exception`, `strftime_now`, `namespace` (no underscore names) and `dict` globals, a
`tojson` filter that keeps non-ASCII text, and the message fields it fills in (`thinking` and
`reasoning_content` from whichever of the reasoning names a message has; None values dropped).
A file without a template gets ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kvq.errors import ModelError
from kvq.gguf import reader as gio

TEMPLATE_KEY = "tokenizer.chat_template"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Namespace(Namespace):
    """`namespace(...)` whose attributes cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # (Namespace's own trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not be {name!r}")


class _Dict:
    """`dict(...)` in a template: builds plain dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in training): its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment(now: Callable[[], datetime]) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: plain dicts without None values, the
    reasoning under `reasoning_content` and `thinking` (gpt-oss's templates read the latter)."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled template with the special tokens it may refer to."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        try:
            self.template = _environment(now).from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelError(f"chat template does not compile: {exc}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text of a chat; `variables` are the template's own options (`tools`,
        `reasoning_effort`, `enable_thinking`...). ModelError for anything it refuses."""
        values = {"tools": None, "documents": None, **variables}
        try:
            return self.template.render(
                messages=template_messages(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **values,
            )
        except jinja2.TemplateError as exc:  # SecurityError and raise_exception included
            raise ModelError(f"chat template refused the messages: {exc}") from None


def load_chat_template(path: str | Path) -> ChatTemplate:
    """The template a GGUF carries (with its BOS/EOS token strings), or ChatML."""
    reader = gio.open_reader(path)
    source = gio.field(reader, TEMPLATE_KEY, None, required=False)
    tokens: list[str] = gio.field(reader, "tokenizer.ggml.tokens", [], required=False)

    def token(key: str) -> str:
        i = gio.int_field(reader, key, -1)
        return tokens[i] if 0 <= i < len(tokens) else ""

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    return ChatTemplate(source if isinstance(source, str) and source else CHATML, bos, eos)
