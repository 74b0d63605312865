"""The quant writers: what gguf (llama.cpp's reference) decodes is close to what was encoded,
and transformers' independent torch dequantizer reads the same bytes the same way."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvq.errors import ModelError
from kvq.model.quants import QUANT_NAMES, SUPPORTED_TYPES, encode, quant_type_named

Q = GGMLQuantizationType
# worst error allowed, as a fraction of the block's largest magnitude
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q6_K: 4e-2,
             Q.Q5_0: 7e-2, Q.Q5_1: 7e-2, Q.Q5_K: 7e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.15,
             Q.Q4_K: 0.15}  # fmt: skip


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
    assert sorted(QUANT_NAMES) == sorted(t.name.lower() for t in SUPPORTED_TYPES)
