"""Walls for `kvq bench pool`'s workers: a memory cgroup each, and a network namespace each.

- **Memory.** A child of this process's own memory cgroup (v1 `memory.limit_in_bytes`, or v2
  `memory.max`) per worker, capped; the worker's process joins it between fork and exec, so
  it never runs a moment outside. `close()` removes the children (after their processes ended).
- **Network.** A namespace `kvqpool-<pid>-<i>` with a veth pair made here, the host end
  `10.213.<i>.1/30` and the namespace end `10.213.<i>.2/30` (a private range, on devices this
  module creates and deletes; nothing else is touched). The worker reaches Redis through the
  bench's delaying proxy listening on the host end.

`skip_reason()` says, in one line, why the bench cannot run here (not root, or no memory
controller); None when it can.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NET_PREFIX = "10.213"  # 10.213.<i>.0/30 per worker


def memory_cgroup_dir(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> Path | None:
    """This process's memory cgroup directory (v1 `memory` hierarchy, else v2 unified with the
    memory controller enabled), or None when there is none."""
    text = proc_cgroup if proc_cgroup is not None else _read("/proc/self/cgroup")
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            d = root / "memory" / path.lstrip("/")
            return d if (d / "memory.limit_in_bytes").is_file() else None
    for line in text.splitlines():
        hid, _, path = line.split(":", 2)
        if hid == "0" and "memory" in _read(str(root / "cgroup.controllers")).split():
            d = root / path.lstrip("/")
            return d if d.is_dir() else None
    return None


def skip_reason(euid: int | None = None, cgroup_dir: Path | None | bool = True) -> str | None:
    """Why `kvq bench pool` cannot run here (one line), or None."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "kvq bench pool: skipped: needs root (memory cgroups and network namespaces)"
    d = memory_cgroup_dir() if cgroup_dir is True else cgroup_dir
    if not d:
        return "kvq bench pool: skipped: no memory cgroup controller under /sys/fs/cgroup"
    return None


def netns_works() -> bool:
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@dataclass
class Sandbox:
    """The cgroups and namespaces of one bench run; `close()` removes what it made."""

    cap_bytes: int
    netns: bool
    base: Path = field(default_factory=lambda: memory_cgroup_dir() or Path("/nonexistent"))
    made: list[Path] = field(default_factory=list)
    spaces: list[str] = field(default_factory=list)

    def cgroup(self, name: str) -> Path:
        d = self.base / f"kvq-pool-{os.getpid()}-{name}"
        d.mkdir(exist_ok=True)
        self.made.append(d)
        v1 = (d / "memory.limit_in_bytes").is_file()
        (d / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(self.cap_bytes))
        return d

    def namespace(self, i: int) -> tuple[str, str]:
        """A namespace for worker `i`: (its name, the host end's address to listen on)."""
        ns, host, peer = f"kvqpool-{os.getpid()}-{i}", f"kvp{i}h{os.getpid()}"[:15], f"kvp{i}n"
        host_ip, ns_ip = f"{NET_PREFIX}.{i}.1", f"{NET_PREFIX}.{i}.2"
        _ip("netns", "add", ns)
        self.spaces.append(ns)
        with contextlib.suppress(subprocess.CalledProcessError):  # left by a killed run whose
            _ip("link", "del", host)  # pid this one reuses (the names hold the pid)
        _ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host)
        _ip("link", "set", host, "up")
        for args in (
            ("addr", "add", f"{ns_ip}/30", "dev", peer),
            ("link", "set", peer, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("-n", ns, *args)
        return ns, host_ip

    def close(self) -> None:
        for ns in self.spaces:  # deleting the namespace deletes its veth end and the pair
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        for d in reversed(self.made):
            with contextlib.suppress(OSError):
                d.rmdir()
        self.spaces.clear()
        self.made.clear()


def usage_bytes(d: Path) -> tuple[int, int]:
    """(current, peak) memory charged to cgroup `d` (peak: 0 where the kernel keeps none)."""
    if (d / "memory.usage_in_bytes").is_file():
        now, peak = d / "memory.usage_in_bytes", d / "memory.max_usage_in_bytes"
    else:
        now, peak = d / "memory.current", d / "memory.peak"
    return int(_read(str(now)) or 0), int(_read(str(peak)) or 0)


def join_cgroup(d: Path) -> None:
    """Put the calling process in cgroup `d` (run between fork and exec)."""
    (d / "cgroup.procs").write_text(str(os.getpid()))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
