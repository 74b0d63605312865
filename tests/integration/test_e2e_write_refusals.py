"""A Redis that refuses writes ends no role, and everything serves again once it writes.

One system of real processes (a monitor, a coordinator, a worker) on the test's own server:
- `maxmemory` under `noeviction`, filled by an operator's key: Redis answers `OOM`;
- (as root) its AOF directory on a small tmpfs, filled by a file: Redis answers `MISCONF`.
While it refuses: every role runs and logs the episode once, the monitor's metrics say why
(`kvq_redis_refusing_writes`), and a request fails at once with `WritesRefused`. Once the
cause is gone: a request completes within seconds.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from e2e_helpers import wait_for

from kvq import client
from kvq.bus import connect
from kvq.config import Settings, child_env, load_settings
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis
from kvq.monitor.metrics import refusing_writes

pytestmark = [pytest.mark.slow, pytest.mark.standalone]
MODEL, ROLES = "tiny", ("monitor", "w0", "coord")
BACK_WITHIN_S = 10.0


def _tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a tmpfs of `size_mb` at `path` (root only); False when it cannot be done."""
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        capture_output=True,
        timeout=30,
    )
    return done.returncode == 0


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """A 48 MB tmpfs for the server's data (AOF on), or None (not root: no AOF case)."""
    path = tmp_path_factory.mktemp("aof") / "fs"
    if not _tmpfs(path, 48):
        yield None
        return
    yield path
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def system(
    disk: Path | None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Children, redis.Redis, Settings]]:
    """The roles as processes on a server of their own, serving."""
    server = EmbeddedRedis(data_dir=disk / "redis" if disk else None).start()
    r = redis.Redis.from_url(server.url)
    if disk is not None:
        r.config_set("appendonly", "yes")
    s = load_settings(
        redis_url=server.url,
        prefix="wr",
        block_ms=100,
        heartbeat_ttl_s=1.0,
        volunteer_poll_s=0.05,
        monitor_poll_s=0.1,
        dispatch_refresh_ms=50,
        slot_poll_s=0.02,
        reconnect_max_s=0.5,
        job_deadline_ms=500,
    )
    logs = tmp_path_factory.mktemp("logs")
    kids = Children(child_env(s), log_dir=str(logs))
    board_r, keys = connect(s.bus), Keys(s.prefix)
    try:
        kids.spawn("monitor", "monitor", "--model", f"{MODEL}={tiny_model}")
        kids.wait_for(lambda: board_r.sismember(keys.models(), MODEL), 120, "registration")
        kids.spawn("w0", "worker", "--id", "w0")
        kids.spawn(
            "coord", "coordinator", "--model", str(tiny_model), "--model-id", MODEL, "--id", "c1"
        )
        kids.wait_for(lambda: _served(board_r, keys), 120, "a first request served")
        yield kids, board_r, s
    finally:
        board_r.close()
        kids.stop_all()
        r.close()
        server.stop()


def _served(r: redis.Redis, keys: Keys) -> bool:
    try:
        return len(client.generate(r, keys, MODEL, prompt="hi", max_tokens=3, timeout_s=10)) == 3
    except (client.RequestFailed, TimeoutError, redis.RedisError):
        return False


def _logged(kids: Children, text: str) -> dict[str, int]:
    """How many lines of each role's log hold `text`."""
    assert kids.log_dir
    out = {}
    for name in ROLES:
        lines = (Path(kids.log_dir) / f"{name}.log").read_text(errors="replace").splitlines()
        out[name] = sum(text in line for line in lines)
    return out


def _refused_then_served(
    kids: Children,
    r: redis.Redis,
    s: Settings,
    code: str,
    reason: str,
    free: Callable[[], None],
) -> float:
    """While Redis refuses (`code`): roles alive, one log line each, the metric, a request
    refused at once. Then `free()`: the seconds until a request is served again."""
    keys = Keys(s.prefix)
    # the monitor writes at every poll; an idle coordinator only on its slot thread
    wait_for(
        lambda: _logged(kids, f"refusing writes ({code})")["monitor"],
        20,
        f"the monitor meeting {code}",
    )
    t0 = time.monotonic()
    with pytest.raises(client.RequestFailed) as refused:
        client.submit(r, keys, MODEL, prompt="hi", max_tokens=3)
    assert time.monotonic() - t0 < 2
    assert refused.value.failure is not None and refused.value.failure.type == "WritesRefused"
    assert f"refuses writes ({code}" in str(refused.value)
    gauge = {s.labels["reason"]: s.value for s in refusing_writes(r).samples}
    assert gauge[reason] == 1, gauge
    assert not kids.dead(), f"{kids.dead()} exited while redis refused writes"
    logged = _logged(kids, f"refusing writes ({code})")
    assert all(n <= 1 for n in logged.values()), f"one line per episode: {logged}"
    t0 = time.monotonic()
    free()
    wait_for(lambda: _served(r, keys), BACK_WITHIN_S, "a request served again")
    back = time.monotonic() - t0
    assert not kids.dead()
    wait_for(lambda: _logged(kids, "redis serves again")["monitor"], 5, "the episode's end")
    return back


def _deleted(r: redis.Redis, names: list[str]) -> bool:
    try:
        r.delete(*names)
    except redis.ResponseError:
        return False
    return True


def test_maxmemory_under_noeviction_ends_no_role(
    system: tuple[Children, redis.Redis, Settings],
) -> None:
    kids, r, s = system
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used + 4 * 2**20))
    filler, i = "operator:filler", 0
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        while True:  # an operator's key grows until the server is full
            r.append(filler, b"x" * 2**16)
            i += 1

    def free() -> None:
        r.delete(filler)
        r.config_set("maxmemory", "0")

    back = _refused_then_served(kids, r, s, "OOM", "oom", free)
    print(f"maxmemory: every role alive, requests refused at once, served again after {back:.1f}s")


def test_a_full_aof_disk_ends_no_role(
    system: tuple[Children, redis.Redis, Settings], disk: Path | None
) -> None:
    if disk is None:
        pytest.skip("needs root to mount a small tmpfs for the AOF directory")
    kids, r, s = system
    free_bytes = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    ballast = disk / "ballast"
    ballast.write_bytes(b"\0" * max(0, free_bytes - 2**20))  # 1 MB left for the AOF
    with pytest.raises(redis.ResponseError, match="MISCONF"):
        for i in range(10_000):  # an operator's writes fill what is left
            r.set(f"operator:{i}", b"x" * 2**14)

    def free() -> None:
        ballast.unlink()  # Redis retries its AOF writes every second: then deletes work
        wait_for(
            lambda: _deleted(r, [f"operator:{i}" for i in range(10_000)]),
            BACK_WITHIN_S,
            "redis writing its AOF again",
        )

    back = _refused_then_served(kids, r, s, "MISCONF", "misconf", free)
    print(
        f"AOF disk full: every role alive, requests refused at once, served again after {back:.1f}s"
    )
