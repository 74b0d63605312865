"""Which machine and CPUs a process computes on.

A worker's heartbeat carries both (`WorkerInfo.machine`, `.cpus`), so that a coordinator can
tell the workers that share its cores from those that add cores (`kvq.coordinator.routing`).
The machine is the running kernel's boot id: processes in containers on one host share it,
as they share its CPUs; two hosts never do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
CPUINFO = Path("/proc/cpuinfo")
# the instruction-set extensions that decide which kernels can run (x86 /proc/cpuinfo names)
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def machine_id() -> str:
    """The kernel's boot id, or "" where there is none (not Linux): "" is never a match."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; all of them where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cpus_text(ids: Iterable[int]) -> str:
    """`{0, 1, 2, 5}` -> "0-2,5" (the form of `taskset -c` and /sys's cpu lists)."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(_span(run))
        run = [i]
    if run:
        out.append(_span(run))
    return ",".join(out)


MAX_CPU = 4096  # CPU ids a heartbeat may name (Linux's default NR_CPUS on x86-64: 8192)


def parse_cpus(text: str) -> frozenset[int]:
    """`cpus_text` read back; an empty set for "" or anything malformed (unknown), or naming a
    CPU id of MAX_CPU or more (so reading one costs at most MAX_CPU set entries)."""
    got: set[int] = set()
    if len(text) > 8 * MAX_CPU:
        return frozenset()
    try:
        for part in filter(None, text.split(",")):
            lo, dash, hi = part.partition("-")
            a, b = int(lo), int(hi if dash else lo)
            if a < 0 or b < a or b >= MAX_CPU:
                return frozenset()
            got.update(range(a, b + 1))
    except ValueError:
        return frozenset()
    return frozenset(got)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def cpu_kind(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's vendor and which of `CPU_FLAGS` it has, as one word list ("" where
    /proc/cpuinfo is not): what a math library's own dispatch may look at."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return " ".join([fields.get("vendor_id", "?"), *[f for f in CPU_FLAGS if f in flags]])


# variables that override MKL's own choice of code (MKL_CBWR=AVX2 changes the bits of torch's
# float32 products on an AVX-512 CPU): the math library's inputs, not kvq settings
MKL_DISPATCH = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")


def mkl_overrides() -> list[str]:
    """`NAME=value` for each of `MKL_DISPATCH` this process runs with."""
    return [f"{k}={os.environ[k]}" for k in MKL_DISPATCH if os.environ.get(k)]
