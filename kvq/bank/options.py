"""Bank options (from the `KVQ_HOT_GIB`, `KVQ_DYN_*`... settings) and the hot budget rules."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.config import NUMA_POLICIES, Settings
from kvq.errors import BankError

GIB = 1 << 30
COLD_PATHS = ("auto", "mapped", "staged")


@dataclass(frozen=True, slots=True)
class BankOptions:
    """How a bank is sized and updated. `hot_bytes=None`: the stock placement's device bytes."""

    hot_bytes: int | None = None
    dynamic: bool = True
    dyn_steps: int = 2000
    dyn_max_swaps: int = 2
    dyn_margin: float = 1.25
    vram_reserve_bytes: int = 2 * GIB
    numa_policy: str = "preferred"
    cold_path: str = "auto"  # auto (measure at start) | mapped (read in place) | staged (copy)
    max_planner_errors: int = 3  # consecutive failed updates before the bank aborts

    def __post_init__(self) -> None:
        checks = (
            (self.hot_bytes is None or self.hot_bytes >= 0, "hot_bytes", ">= 0 or None"),
            (self.dyn_steps >= 1, "dyn_steps", ">= 1"),
            (self.dyn_max_swaps >= 1, "dyn_max_swaps", ">= 1"),
            (math.isfinite(self.dyn_margin) and self.dyn_margin >= 1.0, "dyn_margin", ">= 1"),
            (self.vram_reserve_bytes >= 0, "vram_reserve_bytes", ">= 0"),
            (self.numa_policy in NUMA_POLICIES, "numa_policy", " | ".join(NUMA_POLICIES)),
            (self.cold_path in COLD_PATHS, "cold_path", " | ".join(COLD_PATHS)),
            (self.max_planner_errors >= 1, "max_planner_errors", ">= 1"),
        )
        for ok, name, want in checks:
            if not ok:
                raise BankError(f"bank option {name}={getattr(self, name)!r} must be {want}")

    @classmethod
    def from_settings(cls, s: Settings, **overrides: object) -> BankOptions:
        """Options from the validated settings (`overrides` e.g. cold_path="staged")."""
        values: dict[str, object] = {
            "hot_bytes": None if s.hot_gib is None else int(s.hot_gib * GIB),
            "dynamic": s.dynamic,
            "dyn_steps": s.dyn_steps,
            "dyn_max_swaps": s.dyn_max_swaps,
            "dyn_margin": s.dyn_margin,
            "vram_reserve_bytes": int(s.vram_reserve_gib * GIB),
            "numa_policy": s.numa_policy,
        }
        return cls(**(values | overrides))  # type: ignore[arg-type]


def device_free_bytes(device: torch.device) -> int:
    """Free memory of the compute device now: CUDA free bytes, or available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable from /proc/meminfo, else free pages from sysconf."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_budget(
    opts: BankOptions,
    total_bytes: int,
    free_bytes: int,
    stock_hot_bytes: int | None,
    accelerator: bool = True,
) -> tuple[int, str]:
    """The hot budget in bytes and a sentence saying where it came from.

    Explicit `hot_bytes` wins but must fit the device (free minus reserve): overflow is an
    error. Unset: the stock placement's device bytes when the caller knows them; else what
    kvq's stock loader keeps on an accelerator (every expert, as long as it fits beside the
    reserve), and 0 without one (a CPU node's stock placement is all in RAM: all cold).
    """
    room = max(0, free_bytes - opts.vram_reserve_bytes)
    if opts.hot_bytes is not None:
        if min(opts.hot_bytes, total_bytes) > room:
            raise BankError(
                f"KVQ_HOT_GIB asks for {opts.hot_bytes / GIB:.3f} GiB of hot experts but the "
                f"device has {room / GIB:.3f} GiB free after KVQ_VRAM_RESERVE_GIB; lower one"
            )
        return min(opts.hot_bytes, total_bytes), "KVQ_HOT_GIB"
    if stock_hot_bytes is not None:
        if stock_hot_bytes < 0:
            raise BankError(f"stock placement bytes {stock_hot_bytes} must be >= 0")
        return min(stock_hot_bytes, total_bytes), "the stock placement's device bytes"
    if not accelerator:
        return 0, "no accelerator: the stock placement keeps every expert in RAM, all cold"
    return min(total_bytes, room), "stock placement: every expert that fits beside the reserve"
