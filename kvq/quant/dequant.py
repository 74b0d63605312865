"""Dequantization of GGUF matrices into torch tensors (see `kvq.quant`).

Each fast decoder turns blocks [n, type_size] (uint8) into values [n, block] written into a
float32 view with the float32 operations of gguf's numpy reference, so the results agree bit
for bit. The products of an f16 scale, a 6- or 8-bit sub-scale and a 4- to 6-bit quant have at
most 25 significant bits, so every step but the last multiply or the K-quants' `- dmin * m` is
exact: neither operand order nor fused multiply-adds (as on a GPU) change a bit.

Speed on the CPU comes from few, long, contiguous passes: bits are unpacked in int64 words
(eight bytes per op), sub-blocks are interleaved by `torch.cat` of 16-byte units, and the
float work is one cast plus one or two in-place passes over the output.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvq.errors import ModelError

Q = GGMLQuantizationType
FAST_TYPES: tuple[GGMLQuantizationType, ...] = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.MXFP4,
)
Decoder = Callable[[torch.Tensor, torch.Tensor], None]


def row_bytes(qtype: int, cols: int) -> int:
    """Encoded bytes of one row of `cols` values; ModelError unless rows are whole blocks."""
    block, size = GGML_QUANT_SIZES[_known(qtype)]
    if cols % block:
        raise ModelError(
            f"row length {cols} is not a multiple of the {Q(qtype).name} block size {block}"
        )
    return int(cols // block * size)


_LOW4 = 0x0F0F0F0F0F0F0F0F  # the low nibble of each byte of an int64 word
_LOW2 = 0x0303030303030303  # the low two bits of each byte
_BIT0 = 0x0101010101010101  # the low bit of each byte


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of each block b [n, size], as float32 [n, 1]."""
    return b.view(torch.int16)[:, at // 2, None].view(torch.float16).float()


def _words(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of each block b [n, size] as int64 words [n, (stop - start) // 8]."""
    seg = b[:, start:stop]
    if b.stride(0) % 8 or (b.storage_offset() + start) % 8:
        seg = seg.clone(memory_format=torch.contiguous_format)
    return seg.view(torch.int64)


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """int64 tensors [..., 2k] side by side along the last dim.

    cat copies them as 16-byte complex128 units: one copy per run instead of one per word,
    and a copy moves the bits untouched."""
    return torch.cat([p.view(torch.complex128) for p in parts], dim=-1).view(torch.int64)


def _planes(w: torch.Tensor, count: int, step: int, mask: int) -> list[torch.Tensor]:
    """`count` planes (w >> step * k) & mask of words w, each shaped like w.

    Broadcasting over a new outermost dim keeps each plane's loop long and contiguous."""
    shifts = torch.arange(0, count * step, step, device=w.device).view(count, *[1] * w.dim())
    return list((w.contiguous()[None] >> shifts) & mask)


def _nibbles(w: torch.Tensor) -> torch.Tensor:
    """Words w [..., k] of nibble pairs as [..., 2k]: the k words of low nibbles, then high."""
    return _join([w & _LOW4, (w >> 4) & _LOW4])


def _scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of K-quant blocks b (bytes 4:16), as float32 [n, 8]."""
    w = b[:, 4:16].view(torch.int32)  # [n, 3]: low scales, low mins, high bits of both
    d, m, md = w[:, 0], w[:, 1], w[:, 2]
    sc = torch.stack([d & 0x3F3F3F3F, (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)], dim=1)
    mn = torch.stack([m & 0x3F3F3F3F, ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)], dim=1)
    return sc.view(torch.uint8).float(), mn.view(torch.uint8).float()


def _q8_0(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 34] -> o [n, 32]
    o.copy_(b[:, 2:].view(torch.int8))
    o.mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 18] -> o [n, 32]
    q = _nibbles(_words(b, 2, 18)).view(torch.int8)  # [n, 32] in 0..15
    o.copy_(q.sub_(8))
    o.mul_(_f16(b, 0))


def _affine(b: torch.Tensor, o: torch.Tensor, q: torch.Tensor) -> None:
    """o = (d * sc) * q - dmin * m per 32-value sub-block, for q bytes [n, 256] of b's blocks."""
    sc, mn = _scale_min(b)
    ov = o.view(-1, 32)  # [n * 8, 32]
    ov.copy_(q.view(torch.uint8).view(-1, 32))
    ov.mul_((_f16(b, 0) * sc).view(-1, 1))
    ov.sub_((_f16(b, 2) * mn).view(-1, 1))


def _q4_k(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 144] -> o [n, 256]
    ql = _words(b, 16, 144).view(-1, 4, 4)  # [n, 4, 4]: sub-blocks 2i, 2i+1 share 32 bytes
    _affine(b, o, _nibbles(ql))


def _q5_k(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 176] -> o [n, 256]
    ql = _words(b, 48, 176).view(-1, 4, 4)
    qh = _words(b, 16, 48)  # [n, 4]: bit j of each byte is bit 4 of sub-block j
    high = _join(_planes(qh, 8, 1, _BIT0))  # [n, 32]
    _affine(b, o, torch.add(_nibbles(ql).view(-1, 32), high, alpha=16))  # bytes never carry


def _q6_k(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 210] -> o [n, 256]
    w = _words(b, 0, 192)
    ql, qh = w[:, :16].view(-1, 2, 8), w[:, 16:].view(-1, 2, 4)  # per half of 128 values
    high = _join(_planes(qh, 4, 2, _LOW2))  # [n, 2, 16]
    q = torch.add(_nibbles(ql), high, alpha=16).view(torch.int8).sub_(32)  # [n, 256] in -32..31
    d = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()  # [n, 16]
    ov = o.view(-1, 16)  # [n * 16, 16]
    ov.copy_(q.view(-1, 16))
    ov.mul_(d.view(-1, 1))


# FP4 E2M1 values, doubled (the OCP MX spec's 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives)
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_e2m1_tables: dict[torch.device, torch.Tensor] = {}


def _mxfp4(b: torch.Tensor, o: torch.Tensor) -> None:  # b [n, 17] -> o [n, 32]
    """MXFP4: an E8M0 scale byte, then 16 bytes of E2M1 nibbles (low: values 0-15, high:
    16-31). The scale is taken as half of 2^(e - 127) (llama.cpp's `e8m0_to_fp32_half`, whose
    e < 2 are subnormal floats), times the doubled values: every product is exact."""
    table = _e2m1_tables.get(b.device)
    if table is None:
        table = torch.tensor(_E2M1_X2, dtype=torch.float32, device=b.device)
        _e2m1_tables[b.device] = table
    q = b[:, 1:]  # [n, 16]
    idx = torch.cat((q & 0x0F, q >> 4), dim=-1).long()  # [n, 32]
    e = b[:, :1].to(torch.int32)  # [n, 1]
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    o.copy_(table[idx])
    o.mul_(bits.view(torch.float32))


def _f32(b: torch.Tensor, o: torch.Tensor) -> None:
    o.copy_(b.view(torch.float32))


def _f16_values(b: torch.Tensor, o: torch.Tensor) -> None:
    o.copy_(b.view(torch.float16))


def _bf16(b: torch.Tensor, o: torch.Tensor) -> None:
    o.copy_(b.view(torch.bfloat16))  # bf16 -> f32 is the bits shifted up, as in gguf


_DECODERS: dict[GGMLQuantizationType, Decoder] = {
    Q.F32: _f32,
    Q.F16: _f16_values,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: _mxfp4,
}
# (type, target dtype) pairs that are exact without a float32 detour
_DIRECT = {(Q.F16, torch.float16), (Q.BF16, torch.bfloat16)}


def dequantize(
    raw: torch.Tensor,
    qtype: int,
    shape: tuple[int, int],
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [rows, cols] matrix encoded in `raw` (uint8, rows * row_bytes bytes), as `dtype`
    on raw's device, or written into `out` (contiguous [rows, cols] on raw's device; its
    dtype wins) and returned."""
    kind = _known(qtype)
    rows, cols = shape
    want = rows * row_bytes(kind, cols)
    if raw.dtype != torch.uint8 or raw.numel() != want:
        raise ModelError(
            f"{raw.numel()} {raw.dtype} values cannot hold a {kind.name} matrix {shape} "
            f"({want} bytes); pass the matrix's own uint8 bytes"
        )
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif out.shape != (rows, cols) or not out.is_contiguous() or out.device != raw.device:
        raise ModelError(
            f"out must be a contiguous {rows}x{cols} tensor on {raw.device}, "
            f"not {tuple(out.shape)} on {out.device}"
        )
    if out.numel() == 0:
        return out
    decode = _DECODERS.get(kind)
    if decode is None:
        return out.copy_(_reference(raw.reshape(rows, -1), kind))
    if raw.storage_offset() % 8:  # the decoders view bytes as wider words
        raw = raw.clone()
    block, size = GGML_QUANT_SIZES[kind]
    if block == 1:  # F32, F16, BF16: one row per "block"
        block, size = cols, row_bytes(kind, cols)
    blocks = raw.reshape(-1, size)  # [n, size]
    if out.dtype == torch.float32 or (kind, out.dtype) in _DIRECT:
        decode(blocks, out.view(-1, block))
    else:
        dense = torch.empty(shape, dtype=torch.float32, device=raw.device)
        decode(blocks, dense.view(-1, block))
        out.copy_(dense)
    return out


def _known(qtype: int) -> GGMLQuantizationType:
    """The ggml type numbered `qtype`; ModelError for a number gguf does not define."""
    try:
        return Q(qtype)
    except ValueError:
        raise ModelError(
            f"{qtype} is not a ggml quantization type; use a gguf.GGMLQuantizationType"
        ) from None


def _reference(rows: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """gguf's numpy dequantize of byte rows [rows, row_bytes], as float32 [rows, cols] (CPU)."""
    try:
        with np.errstate(all="ignore"):  # NaN/inf scales decode to NaN/inf, as in llama.cpp
            arr = gguf_dequantize(rows.cpu().numpy(), qtype)
    except NotImplementedError as exc:
        raise ModelError(f"ggml type {qtype.name} cannot be dequantized by gguf: {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
