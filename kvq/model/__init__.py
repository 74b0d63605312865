"""The forward pass of the MoE models kvq serves: a torch backbone for every arch in
`kvq.gguf.arch`, expert slices kept in their GGUF encoding, the routed experts' compute, the KV
cache, sampling and generation.

The file format these are read from is `kvq.gguf`; tokenizers and chat templates are
`kvq.text`. Shapes are numpy order throughout (the reverse of GGUF/ggml dims): the stacked
expert tensors are gate/up `[experts, ffn, hidden]` and down `[experts, hidden, ffn]`.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from kvq.model.backbone import Backbone, KVCache, MoeFn, SeqStep
    from kvq.model.expert_slice import ExpertSlice, decode_slice, load_slice, read_slice_file
    from kvq.model.experts import expert_forward, expert_forward_reference

# public name -> the module that defines it, imported on first access (torch loads then)
_LAZY = {
    "Backbone": "kvq.model.backbone",
    "ExpertSlice": "kvq.model.expert_slice",
    "KVCache": "kvq.model.backbone",
    "MoeFn": "kvq.model.backbone",
    "SeqStep": "kvq.model.backbone",
    "decode_slice": "kvq.model.expert_slice",
    "expert_forward": "kvq.model.experts",
    "expert_forward_reference": "kvq.model.experts",
    "load_slice": "kvq.model.expert_slice",
    "read_slice_file": "kvq.model.expert_slice",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq.model' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups no longer come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backbone",
    "ExpertSlice",
    "KVCache",
    "MoeFn",
    "SeqStep",
    "decode_slice",
    "expert_forward",
    "expert_forward_reference",
    "load_slice",
    "read_slice_file",
]
