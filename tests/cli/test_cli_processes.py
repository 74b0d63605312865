"""The CLI as real processes (issue 30, item 5): the commands that do not compute never load
torch (and stay small and quick); `kvq api` and `kvq server` exit 0 on SIGTERM; `kvq api` on a
busy port exits 1 with one line, before it logs any URL; `kvq api --host --port`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from waiting import wait_for

from kvq.config import Settings

# run one command in-process, then report what it loaded, its peak RSS and its wall time
PROBE = """
import json, resource, sys, time
t0 = time.monotonic()
from kvq.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
use = resource.getrusage(resource.RUSAGE_SELF)
# the peak RSS of this program (VmHWM starts anew at exec; ru_maxrss keeps a forking parent's)
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "s": time.monotonic() - t0,
                  "cpu_s": use.ru_utime + use.ru_stime, "rss_mb": hwm / 1024}),
      file=sys.stderr)
"""
LIGHT = [
    ["health", "redis"],
    ["submit", "--model", "nope", "--prompt", "x"],
    ["config", "show"],
    ["acl"],
    ["deadletter", "list"],
    ["server", "--help"],
    ["model", "list"],
    ["model", "rm", "nope"],
]
# CPU seconds, not wall time: a machine shared with other jobs stretches the wall clock (at a
# load of 5 on 2 cores these commands took 0.8-1.9 s of wall time); importing torch alone
# costs about 2 s of CPU, which is what the bound guards against. Measured at that load:
# config/acl/deadletter/server 0.34-0.40 s CPU; health and submit 0.65 s (they open the board,
# whose module loads the GGUF reader, numpy and the swarm types)
MAX_CPU_S, MAX_RSS_MB = 1.0, 100


def env_of(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    return env | {"KVQ_REDIS_URL": settings.redis_url, "KVQ_PREFIX": settings.prefix} | extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("argv", LIGHT, ids=[a[0] for a in LIGHT])
def test_commands_that_do_not_compute_do_not_import_torch(
    argv: list[str], settings: Settings
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = json.loads(proc.stderr.strip().splitlines()[-1])
    print(
        f"kvq {' '.join(argv)}: {got['s']:.2f} s wall, {got['cpu_s']:.2f} s CPU, "
        f"{got['rss_mb']:.0f} MB"
    )
    assert got["code"] in (0, 1) and not got["torch"], got
    assert got["rss_mb"] < MAX_RSS_MB and got["cpu_s"] < MAX_CPU_S, got


def test_server_does_not_load_torch_and_exits_0_on_sigterm(settings: Settings) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "kvq", "server", "--port", "0"],
        env=env_of(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("redis://")
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            rss_kb = next(int(x.split()[1]) for x in status if x.startswith("VmRSS"))
            print(f"kvq server: {rss_kb / 1024:.0f} MB RSS, torch mapped: {'torch' in maps}")
            assert "torch" not in maps and rss_kb < MAX_RSS_MB * 1024, rss_kb
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()


@pytest.mark.slow
def test_api_host_port_sigterm_and_busy_port(settings: Settings) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvq", "api", "--host", "127.0.0.1", "--port", str(port)]
    env = env_of(settings, KVQ_API_PORT="1")  # the flag wins over the setting
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as proc:
        try:

            def healthy() -> bool:
                assert proc.poll() is None
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200

            wait_for(healthy, 60, "the health port", poll_s=0.1, ignore=httpx.HTTPError)
            health = [
                sys.executable,
                "-m",
                "kvq",
                "health",
                "api",
                "--id",
                f"http://127.0.0.1:{port}",
            ]
            assert subprocess.run(health, env=env, capture_output=True, timeout=60).returncode == 0
            busy = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            assert busy.returncode == 1, busy.stderr
            lines = busy.stderr.strip().splitlines()
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
            assert "http://" not in busy.stderr, "no URL logged for a server that never ran"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()


def test_submit_stops_within_2s_when_the_last_coordinator_leaves(
    settings: Settings, tmp_path: Path
) -> None:
    from kvq.bus.records import CoordStats, SlotState
    from kvq.keys import Keys
    from kvq.monitor import Monitor
    from kvq.tools.synth import make_tiny

    make_tiny(tmp_path / "m.gguf", layers=2, experts=8)
    mon = Monitor.from_settings(settings)
    mon.register("m", tmp_path / "m.gguf")
    state = SlotState(model="m", busy=0, total=4, ts_ms=int(time.time() * 1000))
    mon.board.publish_slots("ghost", state, CoordStats())  # alive, never answers
    cmd = [sys.executable, "-m", "kvq", "submit", "--model", "m", "--prompt", "x"]
    with subprocess.Popen(
        cmd, env=env_of(settings), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stream = Keys(settings.prefix).model_requests("m")

            def queued() -> int:
                assert proc.poll() is None
                return int(mon.board.r.xlen(stream))

            wait_for(queued, 60, "the request queued", poll_s=0.05)
            left = time.monotonic()
            mon.board.forget_coordinator("m", "ghost")  # what a clean stop does
            assert proc.wait(timeout=10) == 1
            assert time.monotonic() - left < 2.0
            assert proc.stderr is not None and "any more" in proc.stderr.read()
        finally:
            proc.kill()
            mon.board.r.close()
