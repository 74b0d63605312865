"""Text in and out of a model: the tokenizer a GGUF file carries (`tokenizer`,
`gguf_tokenizer`, `pretokenizers`), its chat template (`chat`), gpt-oss's harmony format
(`harmony`), tool calls in each family's format (`tool_calls`) and constrained decoding by a
grammar over the vocabulary (`grammar`).
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from kvq.text.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

# public name -> the module that defines it, imported on first access
_LAZY = {
    "ByteTokenizer": "kvq.text.tokenizer",
    "Tokenizer": "kvq.text.tokenizer",
    "load_tokenizer": "kvq.text.tokenizer",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq.text' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups no longer come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ByteTokenizer", "Tokenizer", "load_tokenizer"]
