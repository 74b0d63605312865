"""`KVQ_NUMA_POLICY`: where the cold bank's host pages live on a multi-socket machine.

The cold bank is read by one device over one PCIe root; pages on the other socket cross the
inter-socket link first. The policy is applied once, before the cold bank is allocated:
- `preferred` (default): ask libnuma to prefer the device's node for new pages (falls back to
  other nodes when full). Without libnuma, nothing is changed and the log says so.
- `bind`: restrict this process's CPUs to the device's node (first-touch pages then land there)
  and, with libnuma, bind memory to it. Affects the whole process.
- `off`: leave placement to the OS.
A machine with one NUMA node (every laptop, most clouds' small VMs) has nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from kvq.config import NUMA_POLICIES

log = logging.getLogger(__name__)
SYSFS = Path("/sys")


def numa_nodes(sysfs: Path = SYSFS) -> dict[int, set[int]]:
    """NUMA node -> its CPU ids, from sysfs (empty when the kernel exposes none)."""
    out: dict[int, set[int]] = {}
    for d in sorted((sysfs / "devices/system/node").glob("node[0-9]*")):
        try:
            out[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return out


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def device_node(device: torch.device, nodes: dict[int, set[int]], sysfs: Path = SYSFS) -> int:
    """The node closest to `device`: its PCI device's node on CUDA, else this process's CPUs'."""
    if device.type == "cuda":
        p: Any = torch.cuda.get_device_properties(device)
        try:
            bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            node = int((sysfs / "bus/pci/devices" / bus / "numa_node").read_text())
            if node in nodes:
                return node
        except (AttributeError, OSError, ValueError):
            pass  # older torch without PCI ids, or no sysfs entry: fall back to our CPUs
    mine = os.sched_getaffinity(0)
    return max(nodes, key=lambda n: (len(nodes[n] & mine), -n))


def _libnuma() -> Any:
    name = ctypes.util.find_library("numa")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def apply_numa_policy(policy: str, device: torch.device, sysfs: Path = SYSFS) -> str:
    """Apply the policy (checked by `BankOptions`); return the log line that says what was
    (or was not) done."""
    assert policy in NUMA_POLICIES, policy
    if policy == "off":
        return "numa: off (the OS places the cold bank)"
    nodes = numa_nodes(sysfs)
    if len(nodes) <= 1:
        return f"numa: {policy}: one NUMA node, nothing to do"
    node = device_node(device, nodes, sysfs)
    lib = _libnuma()
    if policy == "bind":
        os.sched_setaffinity(0, nodes[node])
        if lib is not None:
            lib.numa_set_membind(lib.numa_parse_nodestring(str(node).encode()))
            return f"numa: bind: CPUs and memory bound to node {node}"
        return f"numa: bind: CPUs bound to node {node}; memory by first touch (no libnuma)"
    if lib is None:
        log.warning("numa: preferred: libnuma not found, cold pages follow first touch")
        return f"numa: preferred node {node} not applied (no libnuma)"
    lib.numa_set_preferred(ctypes.c_int(node))
    return f"numa: preferred: new host pages prefer node {node}"
