"""`kvq.quant`'s dequantizer timed alone: one matrix against gguf's numpy path and a batch-1
matmul."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from kvq.quant.dequant import _known, dequantize
from kvq.tools.synth.quants import encode


def measure(
    qtype: int, rows: int, cols: int, device: str = "cpu", repeat: int = 20
) -> dict[str, float]:
    """Time `dequantize` of a random valid [rows, cols] `qtype` matrix into a reused buffer.

    Median ms per call (`ms`; `best_ms` the fastest), GB/s of float32 output, and for
    comparison the median ms of gguf's numpy dequantize and of a batch-1 float32 matmul
    x [1, cols] @ W.T of the same matrix.
    """
    kind = _known(qtype)
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    enc = encode(x, kind)  # [rows, row_bytes]
    raw = torch.from_numpy(enc.reshape(-1).copy()).to(device)
    out = torch.empty((rows, cols), dtype=torch.float32, device=device)
    vec = torch.randn(1, cols, dtype=torch.float32, device=device)

    def sync() -> None:
        if out.is_cuda:
            torch.cuda.synchronize()

    def per_call(fn: Callable[[], object]) -> list[float]:
        fn()
        times = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)

    ours = per_call(lambda: dequantize(raw, kind, (rows, cols), out=out))
    ms = ours[len(ours) // 2]
    return {
        "ms": ms,
        "best_ms": ours[0],
        "gb_s": rows * cols * 4 / ms / 1e6,
        "gguf_ms": per_call(lambda: gguf_dequantize(enc, kind))[repeat // 2],
        "matmul_ms": per_call(lambda: vec @ out.T)[repeat // 2],
    }
