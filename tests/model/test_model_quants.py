"""The quant writers: what gguf (llama.cpp's reference) decodes is close to what was encoded,
and transformers' independent torch dequantizer reads the same bytes the same way; random
blocks decode to sane values; each tensor gets the type llama-quantize would give it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvq.errors import ModelError
from kvq.tools.synth.quants import (
    QUANT_NAMES,
    SUPPORTED_TYPES,
    encode,
    fallback_type,
    quant_type_named,
    random_blocks,
    tensor_type,
    use_more_bits,
)

Q = GGMLQuantizationType
# worst error allowed, as a fraction of the block's largest magnitude
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q6_K: 4e-2,
    Q.Q5_0: 7e-2,
    Q.Q5_1: 7e-2,
    Q.Q5_K: 7e-2,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.15,
    Q.Q4_K: 0.15,
    Q.MXFP4: 0.25,
}


def _rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1] = 0.0  # all zero
    x[2] = 0.75  # constant
    x[3] = np.abs(x[3])  # positive only: the K-quant min offset is 0
    x[4] = -np.abs(x[4])  # negative only
    x[5, :256] *= 1e-3  # blocks of very different scales in one row
    return x


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_encode_then_gguf_dequantize_is_close(qtype: GGMLQuantizationType) -> None:
    x = _rows()
    raw = encode(x, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (6, 512 // block * type_size)
    y = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(x.shape)
    assert np.array_equal(y[1], x[1])  # zeros stay exact
    tol = TOLERANCE[qtype]
    for blk_x, blk_y in zip(x.reshape(-1, block), y.reshape(-1, block), strict=True):
        assert np.abs(blk_y - blk_x).max() <= tol * max(np.abs(blk_x).max(), 1e-30) + 1e-7


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=str)
def test_transformers_dequantizer_reads_the_same_values(qtype: GGMLQuantizationType) -> None:
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    raw = encode(_rows(), qtype)
    want = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(6, 512)
    got = hf_dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).reshape(6, 512)
    assert np.array_equal(got.numpy(), want)


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ModelError, match=r"row length \(100,\).*Q4_K block size 256"):
        encode(np.zeros((2, 100), np.float32), Q.Q4_K)
    with pytest.raises(ModelError, match="cannot encode ggml type Q2_K"):
        encode(np.zeros((1, 256), np.float32), Q.Q2_K)
    with pytest.raises(ModelError, match=r"'q3_k' is not supported; choose one of"):
        quant_type_named("q3_k")
    assert quant_type_named("Q4_K") == Q.Q4_K
    # MXFP4 is offered only as the mix `mxfp4` (experts MXFP4, the rest Q8_0)
    assert sorted(QUANT_NAMES) == sorted(t.name.lower() for t in SUPPORTED_TYPES if t != Q.MXFP4)


def test_kept_f32_tensors_follow_llama_quantize() -> None:
    for name, shape in [
        ("blk.0.attn_norm.weight", (64,)),
        ("blk.0.attn_q_norm.weight", (16,)),
        ("blk.0.ffn_gate_inp.weight", (8, 256)),
        ("blk.0.attn_q.bias", (64,)),
        ("blk.0.ffn_gate_inp_shexp.weight", (256,)),
        ("output_norm.weight", (256,)),
    ]:
        assert tensor_type(name, shape, "q4_k_m", 4, 16) == Q.F32, name
    assert tensor_type("blk.0.ffn_gate_shexp.weight", (512, 256), "q6_k", 4, 16) == Q.Q6_K


@pytest.mark.parametrize(
    ("qtype", "row", "want"),
    [
        (Q.Q4_K, 256, Q.Q4_K),
        (Q.Q4_K, 64, Q.Q5_0),
        (Q.Q5_K, 96, Q.Q5_1),
        (Q.Q6_K, 32, Q.Q8_0),
        (Q.Q4_K, 48, Q.F16),
        (Q.Q8_0, 48, Q.F16),
        (Q.Q4_0, 64, Q.Q4_0),
        (Q.F32, 7, Q.F32),
    ],
)
def test_rows_that_are_not_whole_blocks_fall_back(qtype: Q, row: int, want: Q) -> None:
    assert fallback_type(qtype, row) == want
    name = "blk.0.ffn_down_exps.weight"  # experts follow the same rule
    assert tensor_type(name, (4, 32, row), qtype.name.lower(), 2, 4) == want


def test_use_more_bits_is_llama_cpps_rule() -> None:
    # i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, by hand for Qwen3-30B-A3B's 48 layers
    want48 = [0, 1, 2, 3, 4, 5, *range(8, 42, 3), 42, 43, 44, 45, 46, 47]
    assert [i for i in range(48) if use_more_bits(i, 48)] == want48
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


def test_q4_k_m_mix() -> None:
    def t(name: str, shape: tuple[int, ...], experts: int = 128) -> Q:
        return tensor_type(name, shape, "q4_k_m", 48, experts)

    assert t("token_embd.weight", (151936, 2048)) == Q.Q4_K
    assert t("output.weight", (151936, 2048)) == Q.Q6_K
    assert t("output.weight", (1000, 96)) == Q.Q8_0  # rows not whole 256-blocks
    assert t("blk.0.attn_q.weight", (4096, 2048)) == Q.Q4_K
    assert t("blk.2.attn_v.weight", (512, 2048)) == Q.Q6_K
    assert t("blk.6.attn_v.weight", (512, 2048)) == Q.Q4_K
    assert t("blk.8.ffn_down_exps.weight", (128, 2048, 768)) == Q.Q6_K
    assert t("blk.9.ffn_down_exps.weight", (128, 2048, 768)) == Q.Q4_K
    assert t("blk.8.ffn_gate_exps.weight", (128, 768, 2048)) == Q.Q4_K
    assert t("blk.0.ffn_down_shexp.weight", (2048, 5632)) == Q.Q6_K
    # exactly 8 experts (Mixtral): attn_v and attn_k Q8_0, attn_output Q5_K
    assert t("blk.6.attn_v.weight", (1024, 4096), 8) == Q.Q8_0
    assert t("blk.6.attn_k.weight", (1024, 4096), 8) == Q.Q8_0
    assert t("blk.6.attn_output.weight", (4096, 4096), 8) == Q.Q5_K
    assert t("blk.0.ffn_gate_exps.weight", (128, 768, 64)) == Q.Q5_0  # then the fallback
    with pytest.raises(ModelError, match=r"'q3_k_m' is not supported.*q4_k_m"):
        tensor_type("output.weight", (8, 256), "q3_k_m", 2, 4)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_random_blocks_decode_to_finite_zero_mean_values(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, (2, 48, 512), 0.25, np.random.default_rng(1))
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (2, 48, 512 // block * type_size)
    y = np.asarray(dequantize(raw, qtype), dtype=np.float64)
    assert y.shape == (2, 48, 512) and np.isfinite(y).all()
    assert abs(y.mean()) < 0.01 and 0.23 < y.std() < 0.27
    again = random_blocks(qtype, (2, 48, 512), 0.25, np.random.default_rng(1))
    assert np.array_equal(raw, again)
