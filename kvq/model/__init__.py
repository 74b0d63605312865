"""MoE models for kvq: GGUF metadata and slice layout, expert compute, and a torch backbone.

Shapes are numpy order throughout (the reverse of GGUF/ggml dims): the stacked expert tensors
are gate/up `[experts, ffn, hidden]` and down `[experts, hidden, ffn]`.
"""

from kvq.model.backbone import Backbone, KVCache, MoeFn, SeqStep
from kvq.model.experts import expert_forward, expert_forward_reference
from kvq.model.meta import (
    ModelMeta,
    TensorRange,
    meta_from_dict,
    meta_to_dict,
    read_meta,
    slice_layout,
    slice_nbytes,
)
from kvq.model.slices import ExpertSlice, decode_slice, load_slice, read_slice_file
from kvq.model.tiny import make_tiny
from kvq.model.tokenizer import ByteTokenizer

__all__ = [
    "Backbone",
    "ByteTokenizer",
    "ExpertSlice",
    "KVCache",
    "ModelMeta",
    "MoeFn",
    "SeqStep",
    "TensorRange",
    "decode_slice",
    "expert_forward",
    "expert_forward_reference",
    "load_slice",
    "make_tiny",
    "meta_from_dict",
    "meta_to_dict",
    "read_meta",
    "read_slice_file",
    "slice_layout",
    "slice_nbytes",
]
