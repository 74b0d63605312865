"""How near a batch-1 decode step is to the memory roof (`kvq bench model`'s `roofline`).

A decode step of one sequence reads every weight of its blocks once, the routed experts' k
of E per MoE layer and the output head: `decode_bytes`. At `decode_tok_s` tokens a second
that is `decode_gb_s`; `stream_gb_s` is a plain read of as many bytes on the same threads (a
C loop over a buffer of that size on the kernels' OpenMP threads, the best of a few passes), the most any kernel reading
them could reach; `roof_share` is the one over the other.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from kvq.model.qstack import QMatrix, QRows, QStack
from kvq.quant import qdot


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors (dense or encoded) in a weight or in a dataclass of them."""
    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, QMatrix | QStack | QRows):
        return int(obj.raw.numel())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def decode_bytes(bb: Any) -> int:
    """Bytes of weights one batch-1 decode step of backbone `bb` reads: every block's dense
    weights, k experts' gate, up and down per MoE layer, the output head (the embedding reads
    one row)."""
    total = sum(_nbytes(lw) for lw in bb.layers) + _nbytes(bb.output)
    k = bb.meta.expert_used_count
    for sl in bb.experts.values():
        total += k * sum(_nbytes(s) for s in sl.stacks) // max(1, sl.n_experts)
    return total


def stream_gb_s(nbytes: int, threads: int, passes: int = 3) -> float:
    """GB/s of a plain read of `nbytes` on `threads` threads: the int8 kernel library's
    `kvq_stream_read` (its OpenMP threads), else a torch sum; the best of `passes`."""
    buf = torch.ones(max(8, nbytes), dtype=torch.uint8)
    built = qdot.load_configured()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = float("inf")
    try:
        for _ in range(passes):
            t0 = time.perf_counter()
            if built is not None:
                built.lib.kvq_stream_read(buf.data_ptr(), buf.numel(), threads)
            else:
                buf.view(torch.float32)[: buf.numel() // 4].sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return nbytes / best / 1e9


def roofline(bb: Any, decode_tok_s: float, threads: int) -> dict[str, float]:
    """The figures of the module docstring for a decode at `decode_tok_s`."""
    nbytes = decode_bytes(bb)
    achieved = nbytes * decode_tok_s / 1e9
    stream = stream_gb_s(nbytes, threads)
    return {
        "decode_bytes_mb": nbytes / 1e6,
        "decode_gb_s": achieved,
        "stream_gb_s": stream,
        "roof_share": achieved / stream if stream else 0.0,
    }
