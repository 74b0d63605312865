"""Hugging Face `transformers` models carrying the weights of a kvq GGUF file (test-only).

The config of each arch is written from what the real checkpoints use (Qwen3-30B-A3B
renormalises its top-k weights, Qwen1.5-MoE does not, Mixtral does), not from kvq's reading
of the file, so the comparison checks kvq's semantics against an implementation no one here
wrote. Weights are dequantized with gguf; for arch `llama` the Q/K rows are un-permuted with
transformers' own inverse of llama.cpp's converter permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from kvq.catalog import ModelMeta
from kvq.gguf import read_meta


def hf_model(path: str | Path) -> PreTrainedModel:
    """An eager float32 HF model of the right class with every weight of the GGUF at `path`."""
    meta = read_meta(path)
    model = _model_class(meta)
    state = _state_dict(meta, _gguf_tensors(path))
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return model.eval()


def _rope(meta: ModelMeta) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": meta.rope_freq_base, "rope_type": "default"}
    if meta.rope_scaling_type != "none":
        rope.update(rope_type=meta.rope_scaling_type, factor=meta.rope_scaling_factor)
    if meta.rope_scaling_type == "yarn":
        rope["original_max_position_embeddings"] = meta.rope_original_context_length
    return rope


def _model_class(meta: ModelMeta) -> PreTrainedModel:
    common: dict[str, Any] = {
        "vocab_size": meta.vocab_size,
        "hidden_size": meta.embedding_length,
        "num_hidden_layers": meta.block_count,
        "num_attention_heads": meta.head_count,
        "num_key_value_heads": meta.head_count_kv,
        "head_dim": meta.head_dim,
        "rms_norm_eps": meta.rms_eps,
        "max_position_embeddings": meta.context_length,
        "num_experts_per_tok": meta.expert_used_count,
        "tie_word_embeddings": False,
        "rope_parameters": _rope(meta),
        "attn_implementation": "eager",
    }
    e, f = meta.expert_count, meta.expert_feed_forward_length
    if meta.arch == "qwen3moe":
        cfg: Any = Qwen3MoeConfig(
            **common, num_experts=e, moe_intermediate_size=f, norm_topk_prob=True
        )
        return Qwen3MoeForCausalLM(cfg)
    if meta.arch == "qwen2moe":
        fs = meta.expert_shared_feed_forward_length
        cfg = Qwen2MoeConfig(
            **common,
            num_experts=e,
            moe_intermediate_size=f,
            norm_topk_prob=False,
            shared_expert_intermediate_size=fs,
            qkv_bias=True,
        )
        return Qwen2MoeForCausalLM(cfg)
    assert meta.arch == "llama"
    return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=e, intermediate_size=f))


def _gguf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        out[t.name] = torch.from_numpy(arr.reshape(shape).copy())
    return out


def _state_dict(meta: ModelMeta, g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {
        "model.embed_tokens.weight": g["token_embd.weight"],
        "model.norm.weight": g["output_norm.weight"],
        "lm_head.weight": g["output.weight"],
    }
    for i in range(meta.block_count):
        sd.update(_layer_state(meta, g, i))
    return sd


def _layer_state(meta: ModelMeta, g: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    p, hf = f"blk.{i}.", f"model.layers.{i}."
    q, k = g[p + "attn_q.weight"], g[p + "attn_k.weight"]
    if meta.arch == "llama":
        unperm = LlamaTensorProcessor()._reverse_permute_weights
        q = torch.from_numpy(unperm(q.numpy(), meta.head_count, meta.head_count))
        k = torch.from_numpy(unperm(k.numpy(), meta.head_count, meta.head_count_kv))
    sd = {
        hf + "input_layernorm.weight": g[p + "attn_norm.weight"],
        hf + "post_attention_layernorm.weight": g[p + "ffn_norm.weight"],
        hf + "self_attn.q_proj.weight": q,
        hf + "self_attn.k_proj.weight": k,
        hf + "self_attn.v_proj.weight": g[p + "attn_v.weight"],
        hf + "self_attn.o_proj.weight": g[p + "attn_output.weight"],
        hf + "mlp.gate.weight": g[p + "ffn_gate_inp.weight"],
        hf + "mlp.experts.gate_up_proj": torch.cat(
            [g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"]], dim=1
        ),  # [E, 2F, H]: gate rows first
        hf + "mlp.experts.down_proj": g[p + "ffn_down_exps.weight"],  # [E, H, F]
    }
    if meta.arch == "qwen3moe":
        sd[hf + "self_attn.q_norm.weight"] = g[p + "attn_q_norm.weight"]
        sd[hf + "self_attn.k_norm.weight"] = g[p + "attn_k_norm.weight"]
    if meta.arch == "qwen2moe":
        for name in ("q", "k", "v"):
            sd[hf + f"self_attn.{name}_proj.bias"] = g[p + f"attn_{name}.bias"]
        for name in ("gate", "up", "down"):
            sd[hf + f"mlp.shared_expert.{name}_proj.weight"] = g[p + f"ffn_{name}_shexp.weight"]
        sd[hf + "mlp.shared_expert_gate.weight"] = g[p + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    return sd
