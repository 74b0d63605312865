"""The writer side of the ggml quant formats kvq supports, for synthetic models and benches.

Reading always goes through `gguf.quants.dequantize` (llama.cpp's own reference); these
encoders only have to produce bytes it decodes to values close to the input. The formats gguf
can already encode (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) use gguf's encoders; the K-quants
(Q4_K, Q5_K, Q6_K) are encoded here with a simple min/max fit per sub-block, which is valid
but not llama.cpp's error-minimising search.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from kvq.errors import ModelError

Q = GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

# every type kvq reads and writes; dequantization of each is tested against its encoder
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip
QUANT_NAMES: dict[str, GGMLQuantizationType] = {t.name.lower(): t for t in SUPPORTED_TYPES}
_QK_K = 256


def quant_type_named(name: str) -> GGMLQuantizationType:
    """The ggml type for a lower-case name such as `q4_k`; ModelError listing the choices."""
    qtype = QUANT_NAMES.get(name.lower())
    if qtype is None:
        raise ModelError(
            f"quant type {name!r} is not supported; choose one of {sorted(QUANT_NAMES)}"
        )
    return qtype


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
