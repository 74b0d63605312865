"""kvq.quant.dequantize against gguf's numpy dequantize (llama.cpp's reference), bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import ModelError
from kvq.quant import FAST_TYPES, dequantize, row_bytes
from kvq.tools.bench.dequant import measure
from kvq.tools.synth.quants import encode

Q = GGMLQuantizationType
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
ENCODABLE_SLOW = (Q.Q4_1, Q.Q5_0, Q.Q5_1)  # kvq.tools.synth.quants can write these
RANDOM_SLOW = (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS)  # nobody here encodes these: random bytes


def _cols(qtype: GGMLQuantizationType, blocks: int) -> int:
    return blocks * int(GGML_QUANT_SIZES[qtype][0])  # F32, F16, BF16: blocks of one value


def _encoded(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> npt.NDArray[np.uint8]:
    """Random floats of mixed magnitudes (and some exact zeros) encoded as qtype."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-6, 4, (rows, 1))
    x[rng.random((rows, cols)) < 0.05] = 0.0
    return encode(x.astype(np.float32), qtype)


def _random(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> npt.NDArray[np.uint8]:
    """Random bytes: every bit pattern, NaN/inf/subnormal scales and values included."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, row_bytes(qtype, cols)), dtype=np.uint8)


def _reference(enc: npt.NDArray[np.uint8], qtype: GGMLQuantizationType) -> npt.NDArray[np.float32]:
    with np.errstate(all="ignore"):  # random scales may be inf or NaN
        return np.asarray(gguf_dequantize(enc, qtype), dtype=np.float32)


def _shape_cols(enc: npt.NDArray[np.uint8], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(enc.shape[1] // size * block)


def _decode(
    enc: npt.NDArray[np.uint8],
    qtype: GGMLQuantizationType,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize of the byte rows enc [rows, row_bytes], from a flat uint8 tensor on device."""
    raw = torch.from_numpy(enc.reshape(-1).copy()).to(device)
    return dequantize(raw, qtype, (enc.shape[0], _shape_cols(enc, qtype)), dtype, out)


def assert_same_bits(got: torch.Tensor, want: npt.NDArray[np.float32]) -> None:
    """Equal bit patterns (so -0.0 != 0.0), except that any NaN matches any NaN."""
    g = got.detach().cpu().numpy()
    assert g.dtype == np.float32 and g.shape == want.shape
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
    keep = ~np.isnan(want)
    np.testing.assert_array_equal(g.view(np.uint32)[keep], want.view(np.uint32)[keep])


Source = Callable[[GGMLQuantizationType, int, int, int], npt.NDArray[np.uint8]]
SHAPES = [(rows, blocks) for rows in (1, 3, 64) for blocks in (1, 2, 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", [_encoded, _random], ids=["encoded", "random"])
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_fast_types_match_gguf_bit_for_bit(
    qtype: GGMLQuantizationType, source: Source, device: str
) -> None:
    for seed, (rows, blocks) in enumerate(SHAPES):
        enc = source(qtype, rows, _cols(qtype, blocks), seed)
        assert_same_bits(_decode(enc, qtype, device), _reference(enc, qtype))


@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(FAST_TYPES),
    rows=st.integers(1, 9),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 1e-30, 1e-7, 1.0, 6e4, 1e30]),
)
def test_any_magnitude_matches_gguf(
    qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int, scale: float
) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, _cols(qtype, blocks))) * scale).astype(np.float32)
    with np.errstate(all="ignore"):  # huge values overflow f16 scales to inf
        enc = encode(x, qtype)
    assert_same_bits(_decode(enc, qtype), _reference(enc, qtype))


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_out_is_filled_in_place_and_reused(qtype: GGMLQuantizationType) -> None:
    cols = _cols(qtype, 2)
    out = torch.full((3, cols), float("nan"))
    for seed in (1, 2):  # the same buffer twice, as the expert kernel does
        enc = _random(qtype, 3, cols, seed)
        got = _decode(enc, qtype, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_same_bits(out, _reference(enc, qtype))
        assert_same_bits(_decode(enc, qtype), _reference(enc, qtype))


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_other_dtypes_are_the_float32_result_cast(qtype: GGMLQuantizationType) -> None:
    enc = _encoded(qtype, 5, _cols(qtype, 2), 7)
    want = _decode(enc, qtype)
    for dtype in (torch.bfloat16, torch.float16):
        got = _decode(enc, qtype, dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16), want.to(dtype).view(torch.int16))
        out = torch.empty(want.shape, dtype=dtype)
        _decode(enc, qtype, out=out)
        assert torch.equal(out.view(torch.int16), want.to(dtype).view(torch.int16))


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_misaligned_bytes_decode_the_same(qtype: GGMLQuantizationType) -> None:
    enc = _random(qtype, 4, _cols(qtype, 2), 3)
    flat = torch.from_numpy(enc.reshape(-1).copy())
    for shift in (1, 2, 4):
        padded = torch.zeros(flat.numel() + shift, dtype=torch.uint8)
        padded[shift:] = flat
        got = dequantize(padded[shift:], qtype, (4, _shape_cols(enc, qtype)))
        assert_same_bits(got, _reference(enc, qtype))


@pytest.mark.parametrize("qtype", [*ENCODABLE_SLOW, *RANDOM_SLOW], ids=lambda t: t.name)
def test_other_types_still_decode_as_gguf(qtype: GGMLQuantizationType) -> None:
    assert qtype not in FAST_TYPES
    make: Source = _encoded if qtype in ENCODABLE_SLOW else _random
    enc = make(qtype, 3, _cols(qtype, 2), 5)
    assert_same_bits(_decode(enc, qtype), _reference(enc, qtype))
    out = torch.empty(3, _cols(qtype, 2), dtype=torch.bfloat16)
    _decode(enc, qtype, out=out)
    assert torch.equal(out, torch.from_numpy(_reference(enc, qtype)).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [*FAST_TYPES, Q.Q4_1, Q.Q2_K], ids=lambda t: t.name)
def test_wrong_byte_count_names_the_type(qtype: GGMLQuantizationType) -> None:
    cols = _cols(qtype, 2)
    good = 2 * row_bytes(qtype, cols)
    for n in (good - 1, good + 1, 0):
        with pytest.raises(ModelError, match=qtype.name):
            dequantize(torch.zeros(n, dtype=torch.uint8), qtype, (2, cols))
    with pytest.raises(ModelError, match=qtype.name):
        dequantize(torch.zeros(good, dtype=torch.int8), qtype, (2, cols))


def test_bad_calls_say_what_is_wrong() -> None:
    raw = torch.zeros(2 * row_bytes(Q.Q4_K, 256), dtype=torch.uint8)
    with pytest.raises(ModelError, match="block size 256"):
        dequantize(raw, Q.Q4_K, (4, 128))
    with pytest.raises(ModelError, match="contiguous 2x256"):
        dequantize(raw, Q.Q4_K, (2, 256), out=torch.empty(256, 2).T)
    with pytest.raises(ModelError, match="contiguous 2x256"):
        dequantize(raw, Q.Q4_K, (2, 256), out=torch.empty(2, 128))
    with pytest.raises(ModelError, match="not a ggml quantization type"):
        dequantize(raw, 12345, (2, 256))


def test_measure_reports_times() -> None:
    got = measure(Q.Q4_K, 4, 512, repeat=3)
    assert set(got) == {"ms", "best_ms", "gb_s", "gguf_ms", "matmul_ms"}
    assert all(v > 0 for v in got.values())
    assert got["best_ms"] <= got["ms"]
