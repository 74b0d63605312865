"""How many slices a worker holds: a memory budget in published slice bytes.

A worker volunteers while the next slice fits: the market is told the bytes it has left
(`room`) and offers only slices that fit, so no reservation is wasted on a worker that could
not load it. The budget is `KVQ_WORKER_MEMORY_GIB`, or (0, the default) the free memory of the
worker's device when it starts — host RAM for a CPU worker, the GPU's for a CUDA one — less
`KVQ_WORKER_MEMORY_RESERVE_GIB`. It is measured once: the worker's own slices then count
against it, never twice. `KVQ_WORKER_MAX_SLICES` caps the count as well. A slice's bytes are
its published size (`SliceSpec.nbytes`): the worker keeps experts in their stored format.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvq.settings_parts import WorkerSettings

log = logging.getLogger("kvq.worker")

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Budget:
    """`limit` bytes of slices (None: no limit known), at most `max_slices` (0: no cap)."""

    limit: int | None
    max_slices: int = 0

    def room(self, used: int) -> int | None:
        """Bytes still free once `used` are held (None: any size fits)."""
        return None if self.limit is None else max(0, self.limit - used)

    def can_take(self, used: int, held: int) -> bool:
        """Whether to ask for one more slice while holding `held` slices of `used` bytes."""
        if self.max_slices and held >= self.max_slices:
            return False
        room = self.room(used)
        return room is None or room > 0

    @classmethod
    def of(cls, s: WorkerSettings, device: torch.device) -> Budget:
        """The budget of the settings, measuring `device`'s free memory for the auto one."""
        limit = budget_bytes(s.memory_gib, s.memory_reserve_gib, free_memory(device))
        if limit is not None and s.memory_gib <= 0 and limit == 0:
            log.warning(
                "free memory of %s is below KVQ_WORKER_MEMORY_RESERVE_GIB (%.2f): this worker "
                "takes no slice; set KVQ_WORKER_MEMORY_GIB",
                device,
                s.memory_reserve_gib,
            )
        return cls(limit, s.max_slices)


def budget_bytes(memory_gib: float, reserve_gib: float, free: int | None) -> int | None:
    """`memory_gib` in bytes, or for 0 (auto) `free` less the reserve (None: unknown free
    memory, no limit)."""
    if memory_gib > 0:
        return int(memory_gib * GIB)
    if free is None:
        return None
    return max(0, free - int(reserve_gib * GIB))


def free_memory(device: torch.device) -> int | None:
    """Free bytes where `device` keeps slices: the GPU's for CUDA, else host RAM available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available()


def host_available() -> int | None:
    """Host memory available to a new process (Linux `MemAvailable`; elsewhere the free pages),
    or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
