"""MoE models for kvq: GGUF metadata and slice layout, expert compute, a torch backbone for
qwen3moe / qwen2moe / Mixtral (`llama` with experts), and the tokenizer a GGUF carries.

Shapes are numpy order throughout (the reverse of GGUF/ggml dims): the stacked expert tensors
are gate/up `[experts, ffn, hidden]` and down `[experts, hidden, ffn]`.
"""

from kvq.model.backbone import Backbone, KVCache, MoeFn, SeqStep
from kvq.model.experts import expert_forward, expert_forward_reference
from kvq.model.layout import slice_layout, slice_nbytes
from kvq.model.meta import ModelMeta, TensorRange, read_meta
from kvq.model.meta_dict import meta_from_dict, meta_to_dict
from kvq.model.slices import ExpertSlice, decode_slice, load_slice, read_slice_file
from kvq.model.tiny import make_tiny
from kvq.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

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
