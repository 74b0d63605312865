"""The workers of `kvq bench pool`: each in its cgroup (and namespace), behind a delaying proxy.

`start(n, rtt_ms)` makes a fresh set and waits until every slice is held by a live worker and
the copies stop growing; `stop()` ends them and removes their walls. The rest reads the board:
who holds what, copies per slice, coverage without a given worker, CPU seconds from /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvq.bus.redis_board import RedisBoard
from kvq.config import Settings
from kvq.local.procs import Children
from kvq.local.server import _die_with_parent

from .delay_proxy import DelayProxy
from .pool_sandbox import Sandbox, join_cgroup, usage_bytes

SETTLE_S = 3.0  # copies unchanged this long after coverage: the join is done


class PoolWorkers:
    """Worker processes `w0..` of one bench run (see the module docstring)."""

    def __init__(
        self,
        kids: Children,
        board: RedisBoard,
        s: Settings,
        model: str,
        sizes: dict[str, int],
        cpu: int,
        netns: bool,
        budget_bytes: float,
        cap_bytes: int,
    ) -> None:
        self.kids, self.board, self.s, self.model = kids, board, s, model
        self.sizes, self.cpu, self.netns = sizes, cpu, netns
        self.budget_bytes, self.cap_bytes = budget_bytes, cap_bytes
        self.layers = len({sid.split(":")[0] for sid in sizes}) or 1  # L000-000:E.. ids
        self.rtt_ms = 0.0
        self.names: list[str] = []
        self._cgroups: dict[str, Path] = {}
        self._proxies: list[DelayProxy] = []
        self._box: Sandbox | None = None

    def start(self, n: int, rtt_ms: float) -> dict[str, Any]:
        """`n` fresh workers at `rtt_ms`; when every slice is covered and the copies settled:
        {seconds to cover, seconds to settle, copies}."""
        self.rtt_ms, self._box = rtt_ms, Sandbox(self.cap_bytes, self.netns)
        u = urlparse(self.s.redis_url)
        t0 = time.monotonic()
        for i in range(n):
            name = f"w{i}"
            ns, listen = self._box.namespace(i) if self.netns else (None, "127.0.0.1")
            proxy = DelayProxy(u.hostname or "127.0.0.1", u.port or 6379, rtt_ms, listen)
            self._proxies.append(proxy)
            cg = self._cgroups[name] = self._box.cgroup(name)
            env = dict(self.kids.env) | {
                "KVQ_REDIS_URL": f"redis://{listen}:{proxy.port}/0",
                "KVQ_WORKER_MEMORY_GIB": f"{self.budget_bytes / 2**30:.6f}",
            }
            self._spawn(name, ns, cg, env)
        self.kids.wait_for(lambda: self.covered(), 900, "every slice held by a live worker")
        cover_s = time.monotonic() - t0
        last, since = self.copies(), time.monotonic()
        while time.monotonic() - since < SETTLE_S and time.monotonic() - t0 < 300:
            time.sleep(0.25)
            if (now := self.copies()) != last:
                last, since = now, time.monotonic()
        return {"cover_s": round(cover_s, 1), "settled_s": round(since - t0, 1), "copies": last}

    def _spawn(self, name: str, ns: str | None, cg: Path, env: dict[str, str]) -> None:
        cpu = self.cpu

        def preexec() -> None:  # in the child, before exec: dies with us, pinned, capped
            _die_with_parent()
            os.sched_setaffinity(0, {cpu})
            join_cgroup(cg)

        argv = [sys.executable, "-m", "kvq", "worker", "--id", name]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        log = Path(self.kids.log_dir or "/tmp") / f"{name}-{int(self.rtt_ms)}ms.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,
            )
        self.kids.procs[name] = proc
        self.names.append(name)

    def stop(self) -> None:
        for name in self.names:
            proc = self.kids.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for name in self.names:  # its assignments go with its heartbeat; wait for that
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.board.held_by(self.model, name):
                time.sleep(0.25)
        for p in self._proxies:
            p.close()
        if self._box is not None:
            self._box.close()
        self.names, self._proxies, self._cgroups, self._box = [], [], {}, None

    def holders(self, without: str | None = None) -> dict[str, set[str]]:
        """slice -> live workers serving it (`without`: leaving that one out)."""
        out: dict[str, set[str]] = {}
        for v in self.board.workers(self.model):
            if v.alive and v.ready and v.worker_id != without:
                out.setdefault(v.slice_id, set()).add(v.worker_id)
        return out

    def covered(self, without: str | None = None) -> bool:
        return not self.uncovered(without)

    def uncovered(self, without: str | None = None) -> int:
        """Slices no live worker (other than `without`) serves."""
        held = self.holders(without)
        return sum(not held.get(sid) for sid in self.sizes)

    def copies(self) -> int:
        return sum(len(ws) for ws in self.holders().values())

    def kill_busiest(self) -> tuple[str, int, int]:
        """SIGKILL the live worker serving the most slices: (its name, its slices, the slices
        it alone served)."""
        per: dict[str, int] = {}
        held = self.holders()
        for ws in held.values():
            for w in ws:
                per[w] = per.get(w, 0) + 1
        victim = max(sorted(per), key=lambda w: per[w])
        self.kids.procs[victim].send_signal(signal.SIGKILL)
        self.kids.procs.pop(victim).wait(10)
        self.names.remove(victim)
        return victim, per[victim], sum(ws == {victim} for ws in held.values())

    def holdings(self) -> dict[str, dict[str, Any]]:
        """Per live worker: slices served, their bytes, its cgroup's memory now and at peak,
        and its own figures from its last beat (ms per row, load)."""
        per: dict[str, list[str]] = {}
        for sid, ws in self.holders().items():
            for w in ws:
                per.setdefault(w, []).append(sid)
        out = {}
        for w in self.names:
            now, peak = usage_bytes(self._cgroups[w]) if w in self._cgroups else (0, 0)
            info = self.board.worker_info(w)
            out[w] = {
                "slices": len(per.get(w, [])),
                "held_bytes": sum(self.sizes[s] for s in per.get(w, [])),
                "cgroup_bytes": now,
                "cgroup_peak_bytes": peak,
                "cgroup_cap_bytes": self.cap_bytes,
                "ms_per_row": round(info.ms_per_row, 3) if info else None,
                "load": round(info.load, 3) if info else None,
            }
        return out

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of the coordinator and of all live workers."""
        coord = self.kids.procs.get("coordinator")
        workers = [self.kids.procs[n].pid for n in self.names if n in self.kids.procs]
        return {
            "coordinator": _cpu_s(coord.pid) if coord else 0.0,
            "workers": sum(_cpu_s(p) for p in workers),
        }


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
