"""The writer side of the ggml quant formats kvq supports, for synthetic models and benches.

Reading always goes through `gguf.quants.dequantize` (llama.cpp's own reference); these
encoders only have to produce bytes it decodes to values close to the input. The formats gguf
can already encode (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) use gguf's encoders; the K-quants
(Q4_K, Q5_K, Q6_K) are encoded here with a simple min/max fit per sub-block, which is valid
but not llama.cpp's error-minimising search. `random_blocks` writes valid random blocks of any
type directly (no float tensor), for models too big to quantize here.

Which type each tensor gets (`tensor_type`) follows `llama-quantize` (`src/llama-quant.cpp`):

- Kept F32: vectors (1-D), names not ending in `weight` (biases), norms, routers
  (`ffn_gate_inp.weight`), as `tensor_allows_quantization` does.
- Every other matrix gets the requested type, or under the mix `q4_k_m` the Q4_K_M rule of
  `llama_tensor_get_type_impl` (see `_q4_k_m`), or under the mix `mxfp4` the rule of
  `MOSTLY_MXFP4_MOE` (gpt-oss's files): the stacked experts MXFP4, every other matrix Q8_0.
  MXFP4 is encoded by gguf's own encoder (`quantize_blocks`: the scale from the block's
  largest magnitude, each value to the nearest E2M1 value).
- Rows (numpy's last dim, ggml's ne0) that are not whole blocks of that type fall back per
  tensor as `tensor_type_fallback` does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; if the rows
  are not whole 32-blocks either, F16. llama.cpp refuses a 32-block type (Q4_0...Q8_0) on
  such rows; kvq uses F16 there too. Experts follow the same rule as every other matrix.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from kvq.errors import ModelError
from kvq.gguf.reader import SUPPORTED_TYPES

Q = GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

# the types a whole file may be quantized to (MXFP4 only comes as the mix `mxfp4`)
QUANT_NAMES: dict[str, GGMLQuantizationType] = {
    t.name.lower(): t for t in SUPPORTED_TYPES if t != Q.MXFP4
}
MIXES = ("q4_k_m", "mxfp4")  # llama.cpp file types that mix tensor types
_QK_K = 256
# llama.cpp's tensor_type_fallback for rows that are not whole 256-blocks
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def quant_type_named(name: str) -> GGMLQuantizationType:
    """The ggml type for a lower-case name such as `q4_k`; ModelError listing the choices."""
    qtype = QUANT_NAMES.get(name.lower())
    if qtype is None:
        raise ModelError(
            f"quant type {name!r} is not supported; choose one of {sorted(QUANT_NAMES)}"
        )
    return qtype


def check_quant(name: str) -> str:
    """`name` lower-cased if it is a type in QUANT_NAMES or a mix in MIXES, else ModelError."""
    low = name.lower()
    if low not in QUANT_NAMES and low not in MIXES:
        raise ModelError(
            f"quant {name!r} is not supported; choose a type ({', '.join(QUANT_NAMES)}) "
            f"or a mix ({', '.join(MIXES)})"
        )
    return low


def tensor_type(
    name: str, shape: tuple[int, ...], quant: str, n_layers: int, n_experts: int
) -> GGMLQuantizationType:
    """The ggml type llama-quantize gives tensor `name` (numpy `shape`) for `quant`, a type
    name or a mix, in a model of `n_layers` blocks and `n_experts` experts."""
    quant = check_quant(quant)
    keep = len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name
    keep = keep or "ssm_conv1d" in name  # llama-quantize keeps the small conv taps F32
    if keep or "ffn_gate_inp.weight" in name:
        return Q.F32
    if quant == "q4_k_m":
        qtype = _q4_k_m(name, shape[-1], n_layers, n_experts)
    elif quant == "mxfp4":  # MOSTLY_MXFP4_MOE: the stacked experts, else Q8_0
        qtype = Q.MXFP4 if len(shape) == 3 and "_exps." in name else Q.Q8_0
    else:
        qtype = QUANT_NAMES[quant]
    return fallback_type(qtype, shape[-1])


def fallback_type(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    """`qtype` if rows of `row` values are whole blocks of it, else llama.cpp's fallback."""
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    alt = _FALLBACK.get(qtype, Q.F16)
    return alt if row % GGML_QUANT_SIZES[alt][0] == 0 else Q.F16


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, every third one
    in between (`i < n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2`, C integer division)."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def _q4_k_m(name: str, row: int, n_layers: int, n_experts: int) -> GGMLQuantizationType:
    """LLAMA_FTYPE_MOSTLY_Q4_K_M in llama.cpp's `llama_tensor_get_type_impl` (before the
    fallback), for the tensors kvq's archs have: Q4_K by default; `output.weight` Q6_K (Q8_0
    if its rows are not whole 256-blocks); `attn_v` and every `ffn_down*` (experts, shared
    expert) Q6_K where `use_more_bits(layer)` (`attn_qkv`, qwen35moe's DeltaNet input, counts
    as `attn_v`: its ATTENTION_QKV rule is never reached, and each layer has one of the two,
    so the counter is still the layer); with exactly 8 experts (Mixtral) `attn_v` and
    `attn_k` Q8_0 and `attn_output` Q5_K. The layer is parsed from `blk.N.`, as llama.cpp does
    for MoE models (its attn_v counter equals the layer: it visits tensors in layer order)."""
    if name == "output.weight":
        return Q.Q6_K if row % _QK_K == 0 else Q.Q8_0
    match = re.match(r"blk\.(\d+)\.", name)
    layer = int(match.group(1)) if match else 0
    if "attn_v.weight" in name or "attn_qkv.weight" in name:  # llama.cpp: both attn_v-like
        if n_experts == 8:
            return Q.Q8_0
        return Q.Q6_K if use_more_bits(layer, n_layers) else Q.Q4_K
    if n_experts == 8 and "attn_k.weight" in name:
        return Q.Q8_0
    if n_experts == 8 and "attn_output.weight" in name:
        return Q.Q5_K
    if "ffn_down" in name and use_more_bits(layer, n_layers):
        return Q.Q6_K
    return Q.Q4_K


def encode(data: npt.ArrayLike, qtype: GGMLQuantizationType) -> U8:
    """`data` (numpy order, rows in the last dim) encoded as `qtype`, as uint8 rows of bytes."""
    arr = np.ascontiguousarray(data, dtype=np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype not in SUPPORTED_TYPES:
        raise ModelError(f"kvq cannot encode ggml type {qtype.name}")
    if arr.ndim == 0 or arr.shape[-1] % block:
        raise ModelError(
            f"row length {arr.shape[-1:]} is not a multiple of the {qtype.name} block size {block}"
        )
    byte_shape = (*arr.shape[:-1], arr.shape[-1] // block * type_size)
    if qtype == Q.F32:
        return arr.view(np.uint8).reshape(byte_shape)
    if qtype == Q.F16:
        return arr.astype(np.float16).view(np.uint8).reshape(byte_shape)
    encoder = _K_ENCODERS.get(qtype)
    if encoder is None:
        return np.asarray(gguf_quantize(arr, qtype), dtype=np.uint8).reshape(byte_shape)
    blocks = arr.reshape(-1, _QK_K)  # [n_blocks, 256]
    return encoder(blocks).reshape(byte_shape)


def _f16_bytes(x: npt.NDArray[np.floating]) -> U8:
    """[n] floats as [n, 2] little-endian f16 bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _safe_div(a: F32, b: F32) -> F32:
    """a / b with 0 where b == 0."""
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _affine_fit(x: F32, levels: int) -> tuple[U8, U8, U8, U8]:
    """Fit x [n, 8, 32] as d*sc*q - dmin*m, q in 0..levels, with 6-bit sc, m per sub-block.

    Returns d and dmin as f16 bytes [n, 2], packed scales [n, 12] and q [n, 8, 32].
    """
    lo = np.minimum(x.min(axis=-1), 0.0)  # [n, 8] <= 0: ggml's offset only subtracts
    scale = (x.max(axis=-1) - lo) / levels  # [n, 8]
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)  # [n]
    dmin = ((-lo).max(axis=-1) / 63).astype(np.float16).astype(np.float32)  # [n]
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63)  # [n, 8]
    m = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, 63)  # [n, 8]
    step = (d[:, None] * sc)[..., None]  # [n, 8, 1]
    offset = (dmin[:, None] * m)[..., None]  # [n, 8, 1]
    q = np.clip(np.rint(_safe_div(x + offset, np.broadcast_to(step, x.shape))), 0, levels)
    return _f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), q.astype(np.uint8)


def _pack_scales(sc: npt.NDArray[np.floating], m: npt.NDArray[np.floating]) -> U8:
    """Eight 6-bit scales and mins [n, 8] into ggml's 12-byte K-quant layout [n, 12]."""
    s, mn = sc.astype(np.uint8), m.astype(np.uint8)
    low = s[:, :4] | ((s[:, 4:] >> 4) << 6)  # [n, 4]
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)  # [n, 4]
    high = (s[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)  # [n, 4]
    return np.concatenate([low, mid, high], axis=1)


def _nibbles(q: U8) -> U8:
    """q [n, 8, 32] (4-bit) as [n, 128] bytes: sub-block 2c in low, 2c+1 in high nibbles."""
    pairs = q.reshape(q.shape[0], 4, 2, 32)  # [n, 4, 2, 32]
    packed = pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))  # [n, 4, 32]
    return packed.astype(np.uint8).reshape(q.shape[0], 128)


def _encode_q4_k(blocks: F32) -> U8:
    d, dmin, scales, q = _affine_fit(blocks.reshape(-1, 8, 32), 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)  # [n, 144]


def _encode_q5_k(blocks: F32) -> U8:
    d, dmin, scales, q = _affine_fit(blocks.reshape(-1, 8, 32), 31)
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]  # [1, 8, 1]
    qh = (((q >> 4) & 1) << shifts).sum(axis=1, dtype=np.uint8)  # [n, 32] bit j = sub-block j
    low = (q & np.uint8(0x0F)).astype(np.uint8)  # [n, 8, 32]
    return np.concatenate([d, dmin, scales, qh, _nibbles(low)], axis=1)  # [n, 176]


def _encode_q6_k(blocks: F32) -> U8:
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16)  # [n, 16 sub-blocks, 16]
    scale = np.abs(x).max(axis=-1) / 31  # [n, 16]
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)  # [n]
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 127)  # [n, 16]
    step = np.broadcast_to((d[:, None] * sc)[..., None], x.shape)  # [n, 16, 16]
    q = (np.clip(np.rint(_safe_div(x, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    hi = (q >> 4).reshape(n, 2, 4, 32)  # [n, 2, 4, 32] two high bits
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = (hi << shifts).sum(axis=2, dtype=np.uint8)  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)],
        axis=1,
    )  # [n, 210]


_K_ENCODERS = {Q.Q4_K: _encode_q4_k, Q.Q5_K: _encode_q5_k, Q.Q6_K: _encode_q6_k}


# -- random blocks: valid bytes of each type, written directly ------------------------------

_POOL = 4096  # distinct K-quant sub-block scale patterns per tensor (packing each is slow)
# rms of one block's values per unit of its f16 scale d, for the quant layouts below
_RMS = {
    Q.Q8_0: 73.9,
    Q.Q4_0: 4.637,
    Q.Q4_1: 4.610,
    Q.Q5_0: 9.247,
    Q.Q5_1: 9.233,
    Q.Q4_K: 41.86 * 4.610,
    Q.Q5_K: 41.86 * 9.233,
    Q.Q6_K: 41.86 * 18.48,
}


_MXFP4_RMS = float(np.sqrt(np.mean(np.square([0, 1, 2, 3, 4, 6, 8, 12]) / 4.0)))  # per 2^(e-127)


def _mxfp4_scales(std: float, n: int, rng: np.random.Generator) -> U8:
    """E8M0 bytes for n blocks of uniform E2M1 values whose rms over the blocks is `std`."""
    low = int(np.floor(np.log2(std / _MXFP4_RMS)))  # 2^low <= the unit that hits std
    p = ((std / _MXFP4_RMS / 2.0**low) ** 2 - 1) / 3  # P(2^(low + 1)): the mean square fits
    return (127 + low + (rng.random(n) < p)).astype(np.uint8)


def random_blocks(
    qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float, rng: np.random.Generator
) -> U8:
    """Random `qtype` bytes (uint8 rows, as `encode` returns) for numpy `shape`: uniform
    quants, f16 scales of random sign and +-25% spread, so values have mean 0 and rms `std`.
    Affine types get min = -(mid level) * scale, K-quants 6-bit scales in 16..63."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        if qtype == Q.BF16:  # truncate: the high half of each float32
            x16 = (x.view(np.uint32) >> 16).astype("<u2")
            return np.asarray(x16.view(np.uint8), dtype=np.uint8).reshape(byte_shape)
        xs = x.astype("<f4" if qtype == Q.F32 else "<f2")
        return np.asarray(xs.view(np.uint8), dtype=np.uint8).reshape(byte_shape)
    bits = np.asarray(rng.bit_generator.random_raw(-(-n * size // 8)), dtype=np.uint64)
    out: U8 = bits.view(np.uint8)[: n * size].reshape(n, size)  # [n_blocks, type_size]
    if qtype == Q.MXFP4:  # a power-of-two scale: 2^e0 or 2^(e0 + 1), mixed to the rms
        out[:, 0] = _mxfp4_scales(std, n, rng)
        return out.reshape(byte_shape)
    sign = np.where(rng.random(n, dtype=np.float32) < 0.5, -1.0, 1.0)
    d = sign * (std / _RMS[qtype]) * (0.75 + 0.5 * rng.random(n, dtype=np.float32))  # [n]
    pick = rng.integers(0, _POOL, n)  # [n] each block's scale pattern from a small pool
    if qtype == Q.Q6_K:  # ql[128] qh[64] int8 scales[16] d
        out[:, 192:208] = rng.integers(16, 64, (_POOL, 16), dtype=np.uint8)[pick]
        out[:, 208:210] = _f16_bytes(d)
        return out.reshape(byte_shape)
    out[:, 0:2] = _f16_bytes(d)
    if qtype in (Q.Q4_1, Q.Q5_1):  # d, m: values d * q + m, m = -(mid level) * d
        out[:, 2:4] = _f16_bytes(d * (-7.5 if qtype == Q.Q4_1 else -15.5))
    elif qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, scales: d * sc * q - dmin * m, m = sc
        sc = rng.integers(16, 64, (_POOL, 8)).astype(np.float32)
        out[:, 2:4] = _f16_bytes(d * (7.5 if qtype == Q.Q4_K else 15.5))
        out[:, 4:16] = _pack_scales(sc, sc)[pick]
    return out.reshape(byte_shape)
