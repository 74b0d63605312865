"""`kvq bench kernels`: the fused quantized matmul against dequantize-then-matmul, per type,
and the int8-activation C kernel (`kvq.quant.qdot`) against the fused float32 one.

Each timing multiplies by `matrices` distinct random matrices in turn (so the weights come
from RAM, not cache, as in a model) and reports the median ms per call over `repeat` passes; both
paths run in the same process, alternating, so the ratio is what to read on a noisy machine.
`int8_ms` (null where the C kernel cannot be built) is the C kernel on the same matrices and
rows, whatever KVQ_ACTIVATIONS says; `int8_speedup` = fused_ms / int8_ms. `int8_isa_ms` times
the C kernel once per SIMD path this CPU has (`avx2`, `avx2+vnni`, `avx512`; every path gives
the same bits), so a new path is measured against the one it replaces in the same run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvq.quant import dequantize, kernels, qdot
from kvq.tools.synth.quants import random_blocks


@dataclass(frozen=True)
class KernelsBench:
    rows: int = 2048
    cols: int = 1024
    batches: tuple[int, ...] = (1, 8)
    matrices: int = 32
    repeat: int = 3
    threads: int = 0  # 0: torch's count as it is


def _per_call(fn: Any, mats: list[torch.Tensor], repeat: int) -> float:
    """Median ms of one call over `repeat` passes over `mats`: a call that lost its core to
    another process (a shared machine) moves a mean, not the median."""
    times: list[float] = []
    for _ in range(repeat):
        for m in mats:
            t = time.perf_counter()
            fn(m)
            times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def run_kernels_bench(cfg: KernelsBench) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    built = qdot.load_configured()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()
    out: list[dict[str, Any]] = []
    shape = (cfg.rows, cfg.cols)
    for qtype in kernels.KERNEL_TYPES:
        mats = [
            torch.from_numpy(random_blocks(qtype, (cfg.rows, cfg.cols), 0.02, rng))
            for _ in range(cfg.matrices)
        ]
        for b in cfg.batches:
            x = torch.randn(b, cfg.cols)

            def fused(m: torch.Tensor, x: torch.Tensor = x, qt: int = qtype) -> None:
                kernels.matmul_float32(x, m, qt)

            def int8(m: torch.Tensor, x: torch.Tensor = x, qt: int = qtype, isa: int = -1) -> None:
                assert built is not None
                qdot.matmul(built, x.numpy(), m.numpy(), qt, threads, isa)

            def dense(m: torch.Tensor, x: torch.Tensor = x, qt: int = qtype) -> None:
                _ = x @ dequantize(m, qt, shape, torch.float32).T

            fused(mats[0])  # compile / load the kernel
            f_ms = _per_call(fused, mats, cfg.repeat)
            d_ms = _per_call(dense, mats[: max(4, cfg.matrices // 4)], cfg.repeat)
            i_ms, by_isa = None, {}
            if built is not None and qtype in qdot.TYPES:
                int8(mats[0])
                i_ms = _per_call(int8, mats, cfg.repeat)
                for isa in _simd_isas(built):
                    by_isa[qdot.ISA_NAMES[isa]] = _per_call(
                        lambda m, isa=isa: int8(m, isa=isa), mats, cfg.repeat
                    )
            out.append(
                {
                    "type": qtype.name,
                    "rows": b,
                    "fused_ms": f_ms,
                    "dequant_matmul_ms": d_ms,
                    "speedup": d_ms / f_ms,
                    "int8_ms": i_ms,
                    "int8_speedup": f_ms / i_ms if i_ms else None,
                    "int8_isa_ms": by_isa,
                }
            )
    return {
        "shape": [cfg.rows, cfg.cols],
        "threads": threads,
        "results": out,
        "int8_isa": built.best_isa if built is not None else None,
    }


def _simd_isas(built: qdot.Built) -> list[int]:
    """The C kernel's SIMD paths this CPU runs (AVX2 .. AMX, or NEON and NEON + sdot), lowest
    first."""
    return [i for i in built.paths() if i != 0]
