"""Synthetic GGUF models: tiny random ones for tests and demos (`tiny`, `tiny_weights`),
real-sized ones streamed for benches (`presets`), their BPE vocabulary (`bpe`) and the quant
writers (`quants`)."""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from kvq.tools.synth.tiny import make_tiny

_LAZY = {"make_tiny": "kvq.tools.synth.tiny"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq.tools.synth' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups no longer come here
    return value


__all__ = ["make_tiny"]
