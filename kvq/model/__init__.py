"""MoE models for kvq: GGUF metadata and slice layout, expert compute, a torch backbone for
qwen3moe / qwen2moe / Mixtral (`llama` with experts), and the tokenizer a GGUF carries.

Shapes are numpy order throughout (the reverse of GGUF/ggml dims): the stacked expert tensors
are gate/up `[experts, ffn, hidden]` and down `[experts, hidden, ffn]`.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from kvq.catalog import ModelMeta, meta_from_dict, meta_to_dict
    from kvq.model.backbone import Backbone, KVCache, MoeFn, SeqStep
    from kvq.model.experts import expert_forward, expert_forward_reference
    from kvq.model.layout import slice_layout, slice_nbytes
    from kvq.model.meta import read_meta
    from kvq.model.slices import ExpertSlice, decode_slice, load_slice, read_slice_file
    from kvq.model.tiny import make_tiny
    from kvq.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
    from kvq.slices import TensorRange

# public name -> the module that defines it, imported on first access: a process that only
# needs the registry (the board, `kvq api`) does not load torch
_LAZY = {
    "Backbone": "kvq.model.backbone",
    "ByteTokenizer": "kvq.model.tokenizer",
    "ExpertSlice": "kvq.model.slices",
    "KVCache": "kvq.model.backbone",
    "ModelMeta": "kvq.catalog",
    "MoeFn": "kvq.model.backbone",
    "SeqStep": "kvq.model.backbone",
    "TensorRange": "kvq.slices",
    "Tokenizer": "kvq.model.tokenizer",
    "decode_slice": "kvq.model.slices",
    "expert_forward": "kvq.model.experts",
    "expert_forward_reference": "kvq.model.experts",
    "load_slice": "kvq.model.slices",
    "load_tokenizer": "kvq.model.tokenizer",
    "make_tiny": "kvq.model.tiny",
    "meta_from_dict": "kvq.catalog",
    "meta_to_dict": "kvq.catalog",
    "read_meta": "kvq.model.meta",
    "read_slice_file": "kvq.model.slices",
    "slice_layout": "kvq.model.layout",
    "slice_nbytes": "kvq.model.layout",
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
    "ByteTokenizer",
    "ExpertSlice",
    "KVCache",
    "ModelMeta",
    "MoeFn",
    "SeqStep",
    "Tokenizer",
    "TensorRange",
    "decode_slice",
    "expert_forward",
    "expert_forward_reference",
    "load_slice",
    "load_tokenizer",
    "make_tiny",
    "meta_from_dict",
    "meta_to_dict",
    "read_meta",
    "read_slice_file",
    "slice_layout",
    "slice_nbytes",
]
