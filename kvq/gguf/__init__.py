"""The GGUF file format as kvq reads it: the architectures a file may declare (`arch`), its
header read into a `kvq.catalog.ModelMeta` (`meta`), typed access to its fields (`reader`),
where each expert slice's bytes lie (`layout`), the slice table the swarm publishes
(`registry`), a backbone-only copy of a file (`split`) and a plain description of one
(`describe`).

Nothing here runs a model: the forward pass is `kvq.model`, which reads its weights through
this package.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from kvq.gguf.layout import slice_layout, slice_nbytes
    from kvq.gguf.meta import read_meta

# public name -> the module that defines it, imported on first access (numpy and gguf load then)
_LAZY = {
    "read_meta": "kvq.gguf.meta",
    "slice_layout": "kvq.gguf.layout",
    "slice_nbytes": "kvq.gguf.layout",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq.gguf' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups no longer come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["read_meta", "slice_layout", "slice_nbytes"]
