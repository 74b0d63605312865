"""Chat templates: a model's `tokenizer.chat_template` rendered the way transformers does it.

The template is Jinja2 from the model file, so it is untrusted: it runs in an
`ImmutableSandboxedEnvironment` (no attribute access to internals, no mutation of the
arguments) with `trim_blocks` and `lstrip_blocks`, the `raise_exception` and `strftime_now`
globals and a `tojson` filter that keeps non-ASCII text, as transformers'
`apply_chat_template`. A file without a template gets ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvq.errors import ModelError
from kvq.model import gguf_io as gio

TEMPLATE_KEY = "tokenizer.chat_template"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled template with the special tokens it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelError(f"chat template does not compile: {exc}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a chat; ModelError for anything the template refuses."""
        try:
            return self.template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )  # fmt: skip
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
