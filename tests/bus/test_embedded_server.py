"""The embedded server refuses a port another server answers on (issue 12 item 8): it checks
that the server answering is its own child, not whoever holds the port."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvq.errors import ServerError
from kvq.local.server import EmbeddedRedis


def test_a_busy_port_is_refused(redis_server: EmbeddedRedis) -> None:
    with pytest.raises(ServerError, match="in use"):
        EmbeddedRedis(port=redis_server.port).start()


def test_cli_server_on_a_busy_port_exits_1(redis_server: EmbeddedRedis) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvq", "server", "--port", str(redis_server.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "in use" in out.stderr and redis_server.url not in out.stdout


def test_a_relative_data_dir_works(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvq server --dir redis-data` (the README's line): the server changes into its dir
    before it opens its log, so a relative dir used to fail with "Can't open the log file"."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(data_dir="redis-data", persist=True) as srv:
        assert srv.logfile.is_file()
    assert (tmp_path / "redis-data" / "server.log").is_file()
