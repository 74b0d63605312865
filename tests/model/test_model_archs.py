"""The three MoE architectures: metadata read from each, and clear refusals of what kvq does
not run, before any weight is loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from kvq.catalog import meta_from_dict, meta_to_dict
from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf.arch import ARCHS, permute_qk
from kvq.model import Backbone, SeqStep
from kvq.tools.synth.tiny import TinyConfig, write_tiny

CFG = TinyConfig(2, 6, 3, 32, 48, 4, 2, 8, shared_expert_ffn=40)


def _tiny(tmp_path: Path, arch: str, extra: Callable[[GGUFWriter], None] | None = None) -> Path:
    path = tmp_path / f"{arch}.gguf"
    write_tiny(path, CFG, arch=arch, seed=1, extra=extra)
    return path


@pytest.mark.parametrize(
    ("arch", "gguf_arch", "norm", "shared"),
    [
        ("qwen3moe", "qwen3moe", True, 0),
        ("qwen2moe", "qwen2moe", False, 40),
        ("mixtral", "llama", True, 0),
    ],
)
def test_metadata_of_each_arch(
    tmp_path: Path, arch: str, gguf_arch: str, norm: bool, shared: int
) -> None:
    m = read_meta(_tiny(tmp_path, arch))
    assert (m.arch, m.block_count, m.expert_count, m.expert_used_count) == (gguf_arch, 2, 6, 3)
    assert (m.embedding_length, m.expert_feed_forward_length) == (32, 48)
    assert (m.head_count, m.head_count_kv, m.head_dim) == (4, 2, 8)
    assert (m.rope_freq_base, m.rope_scaling_type, m.rope_scaling_factor) == (1e6, "none", 1.0)
    assert m.expert_weights_norm is norm and m.expert_weights_scale == 1.0
    assert m.expert_shared_feed_forward_length == shared
    assert (m.context_length, m.vocab_size, m.rms_eps) == (512, 258, pytest.approx(1e-6))
    assert meta_from_dict(meta_to_dict(m)) == m


def test_file_metadata_overrides_the_arch_defaults(tmp_path: Path) -> None:
    def extra(w: GGUFWriter) -> None:
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(2.5)
        w.add_float32("qwen2moe.attention.scale", 0.25)

    path = _tiny(tmp_path, "qwen2moe", extra)
    m = read_meta(path)
    assert (m.expert_weights_norm, m.expert_weights_scale, m.attention_scale) == (True, 2.5, 0.25)
    seen: list[torch.Tensor] = []
    bb = Backbone.from_gguf(path)

    def moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(w)
        return bb.local_moe(layer, x, ids, w)

    bb.forward([SeqStep([1, 2, 3], bb.new_cache())], moe)
    torch.testing.assert_close(seen[0].sum(-1), torch.full((3,), 2.5))  # renormalised, scaled


def test_qwen2moe_weights_are_not_renormalised(qwen2_backbone: Backbone) -> None:
    sums: list[torch.Tensor] = []

    def moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        sums.append(w.sum(-1))
        return qwen2_backbone.local_moe(layer, x, ids, w)

    qwen2_backbone.forward([SeqStep([5, 6, 7, 8], qwen2_backbone.new_cache())], moe)
    assert all(bool((s < 1 - 1e-3).all()) for s in sums)  # raw top-3 of a softmax over 6


def test_mixtral_qk_rows_are_permuted_like_llama_cpp(mixtral_backbone: Backbone) -> None:
    # the converter groups each head's two halves into interleaved pairs; check on a ramp
    w = np.arange(16, dtype=np.float32)[:, None]  # 2 heads of 8 rows
    got = permute_qk(w, 2)[:, 0].tolist()
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert mixtral_backbone.spec.rope_style == "norm" and ARCHS["qwen3moe"].rope_style == "neox"


def _write(path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, Any]) -> None:
    w = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _keys(a: str, **more: Any) -> dict[str, Any]:
    base = {
        "block_count": 1,
        "embedding_length": 32,
        "attention.head_count": 4,
        "expert_count": 2,
        "expert_used_count": 1,
        "expert_feed_forward_length": 32,
        "context_length": 64,
    }
    return {f"{a}.{k}": v for k, v in {**base, **more}.items()}


def _experts() -> dict[str, Any]:
    """The stacked expert tensors of one layer, and an embedding (for the vocab size)."""
    z = (np.zeros((2, 32, 32), dtype=np.float32), GGMLQuantizationType.F32)
    out = {f"blk.0.ffn_{k}_exps.weight": z for k in ("gate", "up", "down")}
    return {**out, "token_embd.weight": (np.zeros((10, 32), np.float32), GGMLQuantizationType.F32)}


@pytest.mark.parametrize(
    ("arch", "keys", "tensors", "words"),
    [
        (
            "gemma",
            {},
            {},
            r"'gemma' is not supported.*qwen3moe, qwen2moe, olmoe, glm4moe, deepseek2, llama",
        ),
        ("llama", {"llama.block_count": 1}, {}, r"'llama' without experts.*expert_count = 0"),
        (
            "qwen3moe",
            _keys("qwen3moe", **{"rope.scaling.type": "longrope"}),
            _experts(),
            r"rope.scaling.type 'longrope' is not supported",
        ),
        (
            "qwen3moe",
            _keys("qwen3moe", expert_gating_func=3),
            _experts(),
            r"expert_gating_func = 3 is not supported.*softmax \(1\) and sigmoid \(2\)",
        ),
        (
            "qwen3moe",
            _keys("qwen3moe", **{"rope.dimension_count": 4}),
            _experts(),
            r"dimension_count 4 != head size 8: partial rotary",
        ),
        (
            "qwen3moe",
            _keys("qwen3moe", **{"attention.value_length": 16}),
            _experts(),
            r"value_length 16 != key_length 8",
        ),
        (
            "llama",
            _keys("llama"),
            {
                **_experts(),
                "blk.0.ffn_gate.0.weight": (
                    np.zeros((32, 32), np.float32),
                    GGMLQuantizationType.F32,
                ),
            },
            r"each expert as its own tensor.*re-convert",
        ),
        (
            "llama",
            _keys("llama"),
            {**_experts(), "rope_freqs.weight": (np.ones(4, np.float32), GGMLQuantizationType.F32)},
            r"'rope_freqs.weight'.*not supported",
        ),
        # Q8_1 is an intermediate format gguf cannot dequantize (Q2_K and the IQ types it can)
        (
            "qwen3moe",
            _keys("qwen3moe"),
            {
                **_experts(),
                "blk.0.attn_q.weight": (np.zeros((32, 40), np.uint8), GGMLQuantizationType.Q8_1),
            },
            r"'blk.0.attn_q.weight' is stored as Q8_1, which kvq does not support",
        ),
    ],
)
def test_refusals_name_the_problem(
    tmp_path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, Any], words: str
) -> None:
    path = tmp_path / "bad.gguf"
    _write(path, arch, keys, tensors)
    with pytest.raises(ModelError, match=words):
        read_meta(path)
    with pytest.raises(ModelError, match=words):
        Backbone.from_gguf(path)


def test_expert_width_comes_from_the_tensor_when_the_key_is_absent(tmp_path: Path) -> None:
    keys = _keys("llama")
    del keys["llama.expert_feed_forward_length"]
    path = tmp_path / "mixtral-like.gguf"
    _write(path, "llama", keys, _experts())
    assert read_meta(path).expert_feed_forward_length == 32
