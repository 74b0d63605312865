"""The float32 fused kernels (numba): `y = x @ W.T` for W in GGUF blocks, read once, never
dequantized whole. `kvq.quant.kernels` chooses between them and the int8 C kernel.

Two kernels per type, each following the type's block layout in ggml (`dequantize_row_*` in
ggml-quants.c):

- **one row** (`_q8_0` ... `_q6_k`, `_mxfp4`): a block's weights are `d * q` (Q8_0, Q6_K per
  sub-block, MXFP4 with q an E2M1 value from a table)
  or `d * q + m` (Q4_0, the K-quants), so the dot product of a sub-block with x is
  `d * sum(q * x) + m * sum(x)`: the quants are multiplied as small integers converted to
  float32, the scales applied once per sub-block, the sums of x per sub-block computed once.
- **two rows or more** (`tiled`): each weight row is dequantized to float32 once, into a
  buffer that stays in L1, and dotted with every row of x, four rows per pass. Unpacking is
  what the one-row kernel spends its time on, so a batch shares it: 8 rows cost about 2.5x
  one row instead of 8x.

Bit fields are split in float32 arithmetic (`_split`), which is exact for small integers and
vectorizes 8 lanes wide with AVX2, where numba's integer shifts widen to int64 and run 4 lanes
wide or scalar.

Precision: activations and accumulation are float32, as in the dequantize-then-matmul path
(the precision rule: nothing is computed at lower precision than it is stored). The order of
the float32 additions differs from a matmul's (and between the one-row and the batched
kernel), so results agree with it to float32 rounding, not bit for bit; the error against the
float64 reference is pinned by tests/quant/test_kernels.py and stated in docs/models.md. Each
output is computed by one thread in a fixed order, so for the same rows a kernel's result does
not depend on the thread count: a worker and a coordinator that compute the same rows of the
same expert (which is what dispatch sends) agree bit for bit.

Threads: numba's parallel loops (`prange`) over output rows; the caller sets the count and
holds the lock (`kvq.quant.kernels`).
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

# float32 value of every float16 bit pattern: numba has no float16 type on the CPU
_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
# MXFP4: the E2M1 values doubled, and half of each E8M0 scale (gguf's `e8m0_to_fp32_half`)
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
_E8M0_HALF = (
    np.where(
        np.arange(256) < 2,
        np.uint32(0x00200000) << np.arange(256, dtype=np.uint32),
        (np.arange(256, dtype=np.uint32) - 1) << np.uint32(23),
    )
    .astype(np.uint32)
    .view(np.float32)
)
_jit = numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
_inline = numba.njit(inline="always", cache=True)


@_inline
def _f16(row: U8, at: int) -> np.float32:
    """The little-endian float16 at byte `at` of `row`, as float32."""
    return np.float32(_F16[np.int64(row[at]) | (np.int64(row[at + 1]) << 8)])


@_inline
def _split(f: np.float32, base: float) -> tuple[np.float32, np.float32]:
    """(f mod base, f // base) for a small non-negative integer f held in a float32: exact,
    and unlike integer shifts (which numba widens to int64) it vectorizes 8 lanes wide."""
    hi = np.floor(f * np.float32(1.0 / base))
    return f - np.float32(base) * hi, hi


@_inline
def _sums(x: F32, size: int) -> F32:
    """Sums of x [B, K] over consecutive runs of `size` values: [B, K // size]."""
    b_n, k = x.shape
    out = np.zeros((b_n, k // size), np.float32)
    for b in range(b_n):
        for s in range(k // size):
            t = np.float32(0)
            for i in range(size):
                t += x[b, s * size + i]
            out[b, s] = t
    return out


@_jit
def _q8_0(w: U8, x: F32, out: F32) -> None:  # block 32: d f16, 32 x int8
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 32):
                o, k0 = blk * 34, blk * 32
                dot = np.float32(0)
                for i in range(32):
                    _, neg = _split(np.float32(row[o + 2 + i]), 128)  # the int8's sign bit
                    dot += (np.float32(row[o + 2 + i]) - np.float32(256) * neg) * x[b, k0 + i]
                acc += _f16(row, o) * dot
            out[b, n] = acc


@_jit
def _q4_0(w: U8, x: F32, out: F32) -> None:  # block 32: d f16, 16 bytes of nibble pairs
    xs = _sums(x, 32)
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 32):
                o, k0 = blk * 18, blk * 32
                dot = np.float32(0)
                for i in range(16):  # element i: low nibble, element i + 16: high nibble
                    lo, hi = _split(np.float32(row[o + 2 + i]), 16)
                    dot += lo * x[b, k0 + i] + hi * x[b, k0 + 16 + i]
                acc += _f16(row, o) * (dot - np.float32(8) * xs[b, blk])
            out[b, n] = acc


@_jit
def _mxfp4(w: U8, x: F32, out: F32) -> None:  # block 32: E8M0 scale, 16 bytes of E2M1 pairs
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 32):
                o, k0 = blk * 17, blk * 32
                dot = np.float32(0)
                for i in range(16):  # element i: low nibble, element i + 16: high nibble
                    v = row[o + 1 + i]
                    dot += _E2M1_X2[v & 15] * x[b, k0 + i] + _E2M1_X2[v >> 4] * x[b, k0 + 16 + i]
                acc += _E8M0_HALF[row[o]] * dot
            out[b, n] = acc


@_inline
def _bit(row: U8, at: int, j: int) -> np.float32:
    """Bit j of the little-endian bit field starting at byte `at` of `row`, as float32."""
    return np.float32((np.int32(row[at + (j >> 3)]) >> (j & 7)) & 1)


@_jit
def _q5_0(w: U8, x: F32, out: F32) -> None:  # block 32: d f16, qh u32 (fifth bits), 16 bytes
    xs = _sums(x, 32)
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 32):
                o, k0 = blk * 22, blk * 32
                dot = np.float32(0)
                for i in range(16):  # element i: low nibble + bit i, i + 16: high + bit i + 16
                    lo, hi = _split(np.float32(row[o + 6 + i]), 16)
                    lo += np.float32(16) * _bit(row, o + 2, i)
                    hi += np.float32(16) * _bit(row, o + 2, i + 16)
                    dot += lo * x[b, k0 + i] + hi * x[b, k0 + 16 + i]
                acc += _f16(row, o) * (dot - np.float32(16) * xs[b, blk])
            out[b, n] = acc


@_inline
def _k_scale_min(row: U8, o: int, j: int) -> tuple[np.float32, np.float32]:
    """Sub-block j's 6-bit scale and min of the K-quant block at byte o (ggml's
    get_scale_min_k4); the 12 packed bytes start at o + 4."""
    s = o + 4
    if j < 4:
        return np.float32(row[s + j] & 63), np.float32(row[s + j + 4] & 63)
    sc = (row[s + j + 4] & 15) | ((row[s + j - 4] >> 6) << 4)
    m = (row[s + j + 4] >> 4) | ((row[s + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@_jit
def _q4_k(w: U8, x: F32, out: F32) -> None:  # block 256: d, dmin, scales[12], qs[128]
    xs = _sums(x, 32)
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 256):
                o, k0 = blk * 144, blk * 256
                d, dmin = _f16(row, o), _f16(row, o + 2)
                for c in range(4):  # 32 bytes: sub-block 2c in low nibbles, 2c + 1 in high
                    s0, m0 = _k_scale_min(row, o, 2 * c)
                    s1, m1 = _k_scale_min(row, o, 2 * c + 1)
                    q, xo = o + 16 + 32 * c, k0 + 64 * c
                    lo = np.float32(0)
                    hi = np.float32(0)
                    for i in range(32):
                        v_lo, v_hi = _split(np.float32(row[q + i]), 16)
                        lo += v_lo * x[b, xo + i]
                        hi += v_hi * x[b, xo + 32 + i]
                    sb = blk * 8 + 2 * c
                    acc += d * (s0 * lo + s1 * hi) - dmin * (m0 * xs[b, sb] + m1 * xs[b, sb + 1])
            out[b, n] = acc


@_jit
def _q5_k(w: U8, x: F32, out: F32) -> None:  # block 256: d, dmin, scales[12], qh[32], qs[128]
    xs = _sums(x, 32)
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 256):
                o, k0 = blk * 176, blk * 256
                d, dmin = _f16(row, o), _f16(row, o + 2)
                for c in range(4):  # like Q4_K, plus bit 2c / 2c + 1 of qh[i] as the fifth bit
                    s0, m0 = _k_scale_min(row, o, 2 * c)
                    s1, m1 = _k_scale_min(row, o, 2 * c + 1)
                    q, xo = o + 48 + 32 * c, k0 + 64 * c
                    lo = np.float32(0)
                    hi = np.float32(0)
                    shift = np.float32(1.0 / (1 << (2 * c)))
                    for i in range(32):
                        v_lo, v_hi = _split(np.float32(row[q + i]), 16)
                        h = np.floor(np.float32(row[o + 16 + i]) * shift)  # qh[i] >> 2c
                        b0, h1 = _split(h, 2)
                        b1, _ = _split(h1, 2)
                        lo += (v_lo + np.float32(16) * b0) * x[b, xo + i]
                        hi += (v_hi + np.float32(16) * b1) * x[b, xo + 32 + i]
                    sb = blk * 8 + 2 * c
                    acc += d * (s0 * lo + s1 * hi) - dmin * (m0 * xs[b, sb] + m1 * xs[b, sb + 1])
            out[b, n] = acc


@_jit
def _q6_k(w: U8, x: F32, out: F32) -> None:  # block 256: ql[128], qh[64], int8 scales[16], d
    xs = _sums(x, 16)
    for n in numba.prange(w.shape[0]):
        row = w[n]
        for b in range(x.shape[0]):
            acc = np.float32(0)
            for blk in range(x.shape[1] // 256):
                o, k0 = blk * 210, blk * 256
                d = _f16(row, o + 208)
                for half in range(2):  # 128 values: ql[64], qh[32], scales[8]
                    ql, qh, y0 = o + 64 * half, o + 128 + 32 * half, k0 + 128 * half
                    for g in range(2):  # l in [16g, 16g + 16): sub-blocks 8 half + g + {0,2,4,6}
                        t1 = np.float32(0)
                        t2 = np.float32(0)
                        t3 = np.float32(0)
                        t4 = np.float32(0)
                        for i in range(16):
                            l = 16 * g + i  # noqa: E741 (ggml's name)
                            a_lo, a_hi = _split(np.float32(row[ql + l]), 16)
                            c_lo, c_hi = _split(np.float32(row[ql + l + 32]), 16)
                            h0, r = _split(np.float32(row[qh + l]), 4)  # four 2-bit fields
                            h1, r = _split(r, 4)
                            h2, h3 = _split(r, 4)
                            t1 += (a_lo + np.float32(16) * h0) * x[b, y0 + l]
                            t2 += (c_lo + np.float32(16) * h1) * x[b, y0 + l + 32]
                            t3 += (a_hi + np.float32(16) * h2) * x[b, y0 + l + 64]
                            t4 += (c_hi + np.float32(16) * h3) * x[b, y0 + l + 96]
                        sc = o + 192 + 8 * half + g
                        sb = (y0 + 16 * g) // 16  # x sums of the four sub-blocks: sb + 2j
                        part = np.float32(0)
                        for j, t in enumerate((t1, t2, t3, t4)):
                            s = np.int32(row[sc + 2 * j])
                            s = s - ((s >> 7) << 8)  # int8
                            part += np.float32(s) * (t - np.float32(32) * xs[b, sb + 2 * j])
                        acc += d * part
            out[b, n] = acc


# ---- two or more rows: dequantize each weight row once, then dot it with every row of x ----


@_inline
def _i8(row: U8, at: int) -> np.float32:
    """The int8 at byte `at` of `row`, as float32."""
    v = np.int32(row[at])
    return np.float32(v - ((v >> 7) << 8))


@_inline
def _row_q8_0(row: U8, buf: F32, k: int) -> None:
    for blk in range(k // 32):
        o, k0 = blk * 34, blk * 32
        d = _f16(row, o)
        for i in range(32):
            v = np.float32(row[o + 2 + i])
            _, neg = _split(v, 128)
            buf[k0 + i] = d * (v - np.float32(256) * neg)


@_inline
def _row_q4_0(row: U8, buf: F32, k: int) -> None:
    for blk in range(k // 32):
        o, k0 = blk * 18, blk * 32
        d = _f16(row, o)
        for i in range(16):
            lo, hi = _split(np.float32(row[o + 2 + i]), 16)
            buf[k0 + i] = d * (lo - np.float32(8))
            buf[k0 + 16 + i] = d * (hi - np.float32(8))


@_inline
def _row_q5_0(row: U8, buf: F32, k: int) -> None:
    for blk in range(k // 32):
        o, k0 = blk * 22, blk * 32
        d = _f16(row, o)
        for i in range(16):
            lo, hi = _split(np.float32(row[o + 6 + i]), 16)
            buf[k0 + i] = d * (lo + np.float32(16) * _bit(row, o + 2, i) - np.float32(16))
            buf[k0 + 16 + i] = d * (hi + np.float32(16) * _bit(row, o + 2, i + 16) - np.float32(16))


@_inline
def _row_mxfp4(row: U8, buf: F32, k: int) -> None:
    for blk in range(k // 32):
        o, k0 = blk * 17, blk * 32
        d = _E8M0_HALF[row[o]]
        for i in range(16):
            v = row[o + 1 + i]
            buf[k0 + i] = d * _E2M1_X2[v & 15]
            buf[k0 + 16 + i] = d * _E2M1_X2[v >> 4]


@_inline
def _row_q45_k(row: U8, buf: F32, k: int, five: bool) -> None:
    """Q4_K, or Q5_K with `five` (its qh[32] before qs and the fifth bit from it)."""
    size, qs = (176, 48) if five else (144, 16)
    for blk in range(k // 256):
        o, k0 = blk * size, blk * 256
        d, dmin = _f16(row, o), _f16(row, o + 2)
        for c in range(4):
            s0, m0 = _k_scale_min(row, o, 2 * c)
            s1, m1 = _k_scale_min(row, o, 2 * c + 1)
            a0, z0, a1, z1 = d * s0, dmin * m0, d * s1, dmin * m1
            q, y = o + qs + 32 * c, k0 + 64 * c
            shift = np.float32(1.0 / (1 << (2 * c)))
            for i in range(32):
                lo, hi = _split(np.float32(row[q + i]), 16)
                if five:
                    b0, h1 = _split(np.floor(np.float32(row[o + 16 + i]) * shift), 2)
                    b1, _ = _split(h1, 2)
                    lo += np.float32(16) * b0
                    hi += np.float32(16) * b1
                buf[y + i] = a0 * lo - z0
                buf[y + 32 + i] = a1 * hi - z1


@_inline
def _row_q6_k(row: U8, buf: F32, k: int) -> None:
    for blk in range(k // 256):
        o, k0 = blk * 210, blk * 256
        d = _f16(row, o + 208)
        for half in range(2):
            ql, qh, y0 = o + 64 * half, o + 128 + 32 * half, k0 + 128 * half
            sc = o + 192 + 8 * half
            for g in range(2):  # l in [16g, 16g + 16): scales sc + g + {0, 2, 4, 6}
                s0, s1 = d * _i8(row, sc + g), d * _i8(row, sc + g + 2)
                s2, s3 = d * _i8(row, sc + g + 4), d * _i8(row, sc + g + 6)
                for i in range(16):
                    l = 16 * g + i  # noqa: E741 (ggml's name)
                    a_lo, a_hi = _split(np.float32(row[ql + l]), 16)
                    c_lo, c_hi = _split(np.float32(row[ql + l + 32]), 16)
                    h0, r = _split(np.float32(row[qh + l]), 4)
                    h1, r = _split(r, 4)
                    h2, h3 = _split(r, 4)
                    buf[y0 + l] = s0 * (a_lo + np.float32(16) * h0 - np.float32(32))
                    buf[y0 + l + 32] = s1 * (c_lo + np.float32(16) * h1 - np.float32(32))
                    buf[y0 + l + 64] = s2 * (a_hi + np.float32(16) * h2 - np.float32(32))
                    buf[y0 + l + 96] = s3 * (c_hi + np.float32(16) * h3 - np.float32(32))


@_inline
def _dot_rows(buf: F32, x: F32, out: F32, n: int) -> None:
    """out[:, n] = x @ buf, four rows of x per pass over buf (one load of w for four FMAs)."""
    b, k = 0, x.shape[1]
    while b + 4 <= x.shape[0]:
        t0, t1, t2, t3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
        for i in range(k):
            v = buf[i]
            t0 += v * x[b, i]
            t1 += v * x[b + 1, i]
            t2 += v * x[b + 2, i]
            t3 += v * x[b + 3, i]
        out[b, n], out[b + 1, n], out[b + 2, n], out[b + 3, n] = t0, t1, t2, t3
        b += 4
    while b < x.shape[0]:
        t = np.float32(0)
        for i in range(k):
            t += buf[i] * x[b, i]
        out[b, n] = t
        b += 1


_T_Q8_0, _T_Q4_0, _T_Q4_K, _T_Q5_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K)
_T_Q5_0, _T_Q6_K, _T_MXFP4 = int(Q.Q5_0), int(Q.Q6_K), int(Q.MXFP4)
_CHUNK = 16  # weight rows per parallel task (one float32 row buffer each)


@_jit
def tiled(qtype: int, w: U8, x: F32, out: F32) -> None:
    """x [B, K] @ W.T for B >= 2: each weight row is dequantized to float32 once (the same
    values as `kvq.quant.dequantize`) into a buffer that stays in L1, then dotted with all B
    rows, so the unpacking, which is what the one-row kernels spend their time on, is shared."""
    n_rows, k = w.shape[0], x.shape[1]
    for chunk in numba.prange((n_rows + _CHUNK - 1) // _CHUNK):
        buf = np.empty(k, np.float32)
        for n in range(chunk * _CHUNK, min(n_rows, chunk * _CHUNK + _CHUNK)):
            if qtype == _T_Q8_0:
                _row_q8_0(w[n], buf, k)
            elif qtype == _T_Q4_0:
                _row_q4_0(w[n], buf, k)
            elif qtype == _T_Q5_0:
                _row_q5_0(w[n], buf, k)
            elif qtype == _T_Q4_K or qtype == _T_Q5_K:
                _row_q45_k(w[n], buf, k, qtype == _T_Q5_K)
            elif qtype == _T_Q6_K:
                _row_q6_k(w[n], buf, k)
            else:
                _row_mxfp4(w[n], buf, k)
            _dot_rows(buf, x, out, n)


ONE_ROW = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q5_0: _q5_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: _mxfp4,
}
