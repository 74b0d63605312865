"""Issue 14 item 1's third mode on real processes: a server and a Sentinel watching it (both the
bundled binary), and kvq's clients (the roles' and `kvq api`'s asyncio one) finding the master
through `redis+sentinel://host:port/name`."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.bus import connect
from kvq.bus.connection import close_async, connect_async
from kvq.config import load_settings
from kvq.local.server import EmbeddedRedis, find_server_binary, free_port

pytestmark = pytest.mark.standalone  # it starts its own server, never a cluster


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[str]:
    with EmbeddedRedis() as master:
        port = free_port()
        conf = tmp_path / "sentinel.conf"  # Sentinel rewrites its config file: a writable one
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor kvqmaster 127.0.0.1 {master.port} 1\n"
        )
        proc = subprocess.Popen(  # the bundled server binary, fixed arguments
            [find_server_binary(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield f"redis+sentinel://127.0.0.1:{port}/kvqmaster"
        finally:
            proc.terminate()
            proc.wait(10)


def wait_master(url: str, timeout_s: float = 20.0) -> None:
    def answers() -> bool:
        r = connect(load_settings(redis_url=url).bus)
        try:
            return bool(r.ping())
        finally:
            r.close()

    # the sentinel has not found its master yet: any error, until the deadline
    wait_for(answers, timeout_s, "the master through sentinel", poll_s=0.2, ignore=Exception)


def test_roles_and_the_api_client_reach_the_master_through_sentinel(sentinel_url: str) -> None:
    settings = load_settings(redis_url=sentinel_url)
    assert settings.bus.mode == "sentinel"
    wait_master(sentinel_url)
    r = connect(settings.bus)
    try:
        r.xadd("kvq:{t}:s", {"k": "v"})
        assert r.xlen("kvq:{t}:s") == 1
        role = r.execute_command("ROLE")
        assert role[0] in (b"master", "master"), "writes go to the master"
    finally:
        r.close()

    async def through_async() -> int:
        client = connect_async(settings.bus)  # `kvq api` used to refuse sentinel
        try:
            return int(await client.xlen("kvq:{t}:s"))
        finally:
            await close_async(client)

    assert asyncio.run(through_async()) == 1
