"""`kvq bench experts`: expert FFN throughput next to plain matmuls, and slice load rates.

Expert FFN: one slice of `experts` experts (default: Qwen3-30B-A3B's sizes, hidden 2048,
expert FFN 768), every token routed to `experts_used` distinct experts of the slice. The
baseline runs, in the same process and with the same row counts per expert, only the three
matmuls per expert on inputs already gathered into contiguous blocks: the work no routing code
can avoid. `ratio_vs_matmul` = FFN GFLOP/s / baseline GFLOP/s (1.0: no routing overhead).
FLOPs are counted as 6 * hidden * ffn per (token, expert) pair for both.

Slice load: bytes of a `load_experts`-expert slice encoded in each quant type, decoded
(dequantized) into float32 tensors as a worker does after download; MB/s of encoded bytes.
A type whose block does not divide the sizes is reported as skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from kvq.device import timed_call
from kvq.errors import ConfigError
from kvq.model.expert_slice import ExpertSlice, decode_slice
from kvq.model.experts import expert_forward
from kvq.slices import EXPERT_KINDS, TensorRange
from kvq.tools.synth.quants import QUANT_NAMES, encode


@dataclass(frozen=True)
class ExpertsBench:
    """Sizes and repetitions of one bench run."""

    hidden: int = 2048
    expert_ffn: int = 768
    experts: int = 16
    experts_used: int = 8
    batches: tuple[int, ...] = (1, 8, 64)
    repeat: int = 5
    load_experts: int = 2
    quants: tuple[str, ...] = tuple(QUANT_NAMES)
    device: str = "cpu"
    seed: int = 0

    def check(self) -> None:
        """ConfigError naming the first bad size."""
        for name in ("hidden", "expert_ffn", "experts", "experts_used", "repeat", "load_experts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench experts {name}={getattr(self, name)} must be >= 1")
        if self.experts_used > self.experts:
            raise ConfigError(
                f"bench experts experts_used={self.experts_used} exceeds experts={self.experts}"
            )
        if not self.batches or min(self.batches) < 1:
            raise ConfigError(f"bench experts batches {self.batches} must be positive")


def run_experts_bench(cfg: ExpertsBench) -> dict[str, Any]:
    """Measure and return the figures as plain values (see the module docstring)."""
    cfg.check()
    device = torch.device(cfg.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(cfg.seed)
    sl = _random_slice(cfg, gen).to(device, dtype)
    rows = [_ffn_row(cfg, sl, b, gen) for b in cfg.batches]
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "shape": {
            "hidden": cfg.hidden,
            "expert_ffn": cfg.expert_ffn,
            "experts": cfg.experts,
            "experts_used": cfg.experts_used,
        },
        "expert_ffn": rows,
        "ratio_vs_matmul": {str(r["batch"]): r["ratio_vs_matmul"] for r in rows},
        "slice_load": [_load_row(cfg, q) for q in cfg.quants],
    }


def _random_slice(cfg: ExpertsBench, gen: torch.Generator) -> ExpertSlice:
    e, f, h = cfg.experts, cfg.expert_ffn, cfg.hidden
    return ExpertSlice(
        0,
        0,
        e,
        torch.randn(e, f, h, generator=gen) / h**0.5,  # [E, F, H]
        torch.randn(e, f, h, generator=gen) / h**0.5,  # [E, F, H]
        torch.randn(e, h, f, generator=gen) / f**0.5,  # [E, H, F]
    )


def _best_s(fns: Sequence[Callable[[], object]], repeat: int, device: torch.device) -> list[float]:
    """Fastest of `repeat` timed calls of each fn, after a warm-up; the fns take turns so a
    burst of load on a shared machine hits all of them alike."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timed_call(fn, device))
    return best


def _ffn_row(
    cfg: ExpertsBench, sl: ExpertSlice, batch: int, gen: torch.Generator
) -> dict[str, Any]:
    g, u, d = sl.stacks
    assert isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor)
    assert isinstance(d, torch.Tensor)
    dev, dtype = g.device, g.dtype
    x = torch.randn(batch, cfg.hidden, generator=gen).to(dev, dtype)  # [T, H]
    ids = torch.stack(
        [torch.randperm(cfg.experts, generator=gen)[: cfg.experts_used] for _ in range(batch)]
    ).to(dev)  # [T, k]
    w = torch.softmax(torch.randn(batch, cfg.experts_used, generator=gen), -1).to(dev)  # [T, k]
    # baseline inputs: each expert's rows already contiguous, same counts as the routed run
    counts = torch.bincount(ids.flatten(), minlength=cfg.experts).tolist()
    blocks = [
        (e, torch.randn(c, cfg.hidden, generator=gen).to(dev, dtype))
        for e, c in enumerate(counts)
        if c
    ]

    def matmuls() -> None:
        for e, xe in blocks:
            (xe @ g[e].T, xe @ u[e].T)[0] @ d[e].T

    with torch.no_grad():
        t_ffn, t_mm = _best_s([lambda: expert_forward(sl, x, ids, w), matmuls], cfg.repeat, dev)
    flops = 6.0 * cfg.hidden * cfg.expert_ffn * batch * cfg.experts_used
    ffn, mm = flops / t_ffn / 1e9, flops / t_mm / 1e9
    return {
        "batch": batch,
        "ffn_ms": t_ffn * 1e3,
        "matmul_ms": t_mm * 1e3,
        "ffn_gflops": ffn,
        "matmul_gflops": mm,
        "ratio_vs_matmul": ffn / mm,
    }


def _load_row(cfg: ExpertsBench, quant: str) -> dict[str, Any]:
    qtype = QUANT_NAMES[quant]
    n, f, h = cfg.load_experts, cfg.expert_ffn, cfg.hidden
    block = GGML_QUANT_SIZES[qtype][0]
    if h % block or f % block:
        return {"quant": quant, "skipped": f"hidden {h} / expert_ffn {f} not multiples of {block}"}
    rng = np.random.default_rng(cfg.seed)
    shapes = {"gate": (f, h), "up": (f, h), "down": (h, f)}
    blobs = [
        encode(rng.standard_normal((n, *shapes[k]), dtype=np.float32), qtype).tobytes()
        for k in EXPERT_KINDS
    ]
    layout = [
        TensorRange(f"bench.{k}", k, 0, len(b), int(qtype), shapes[k])
        for k, b in zip(EXPERT_KINDS, blobs, strict=True)
    ]
    (secs,) = _best_s(
        [lambda: decode_slice(layout, blobs, 0, 0, n).dense_copy(torch.float32)],
        cfg.repeat,
        torch.device("cpu"),
    )
    nbytes = sum(len(b) for b in blobs)
    return {"quant": quant, "bytes": nbytes, "ms": secs * 1e3, "mb_per_s": nbytes / secs / 1e6}
