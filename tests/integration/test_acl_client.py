"""The client role under the user `kvq acl` prints for it: a queued request waited for past the
lost check (which reads no request), a cancel, `kvq submit` waiting more than 5 s; and `kvq api`
under that user with a per-key limit refused at start in one line (it needs the api role's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from acl_helpers import RoleSettings, denials
from e2e_helpers import wait_for

from kvq import client, wire
from kvq.bus.records import SlotState
from kvq.config import Settings, child_env
from kvq.keys import COORDINATOR_GROUP, Keys
from kvq.local.server import free_port


def _registered(r: redis.Redis, keys: Keys) -> None:
    r.sadd(keys.models(), "m")
    r.hset(keys.model_meta("m"), "request_shards", 1)


def _answer(r: redis.Redis, keys: Keys, rid: str, entry: str, stream: str) -> None:
    """What a coordinator does with a request it took: its events, then ack and delete."""
    for ev in (
        wire.ReplyEvent(kind="token", index=0, token_id=7, attempt=1, entry=entry),
        wire.ReplyEvent(kind="done", index=1, attempt=1, entry=entry),
    ):
        r.xadd(keys.request_reply(rid), wire.encode(ev))
    r.xack(stream, COORDINATOR_GROUP, entry)
    r.xdel(stream, entry)


def _waits(cr: redis.Redis, keys: Keys, rid: str) -> None:
    """`events` keeps waiting (its lost check runs several times) until its timeout."""
    with pytest.raises(TimeoutError):
        list(client.events(cr, keys, rid, timeout_s=0.6, lost_after_s=0.1))


def test_a_request_is_waited_for_in_every_state_under_the_client_user(
    settings: Settings, r: redis.Redis, as_role: RoleSettings
) -> None:
    keys = Keys(settings.prefix)
    _registered(r, keys)
    cr = redis.Redis.from_url(as_role("client").redis_url)
    rid = client.send(cr, keys, "m", prompt="hi")
    _waits(cr, keys, rid)  # queued before any coordinator made the group
    r.xgroup_create(rid.stream, COORDINATOR_GROUP, id="0")
    _waits(cr, keys, rid)  # not yet delivered
    r.xreadgroup(COORDINATOR_GROUP, "c1", {rid.stream: ">"})
    _waits(cr, keys, rid)  # delivered, pending: generating
    client.cancel(cr, keys, "m", rid)
    assert r.xlen(keys.model_cancels("m")) == 1
    _answer(r, keys, rid, rid.entry, rid.stream)
    got = list(client.events(cr, keys, rid, timeout_s=5, lost_after_s=0.1))
    assert [e.kind for e in got] == ["token", "done"]
    lost = client.send(cr, keys, "m", prompt="hi")
    r.xreadgroup(COORDINATOR_GROUP, "c1", {rid.stream: ">"})
    r.xack(lost.stream, COORDINATOR_GROUP, lost.entry)  # acked, never answered: Redis lost it
    r.xdel(lost.stream, lost.entry)
    with pytest.raises(client.RequestFailed, match="was lost"):
        list(client.events(cr, keys, lost, timeout_s=5, lost_after_s=0.1))
    gone = client.send(cr, keys, "m", prompt="x")
    r.delete(gone.stream)  # the whole stream gone (FLUSHALL, a restart without persistence)
    with pytest.raises(client.RequestFailed, match="was lost"):
        list(client.events(cr, keys, gone, timeout_s=5, lost_after_s=0.1))
    assert denials(r, settings.prefix) == []


def test_kvq_submit_waits_past_5_s_under_the_client_user(
    settings: Settings, r: redis.Redis, as_role: RoleSettings
) -> None:
    keys = Keys(settings.prefix)
    _registered(r, keys)
    stream = keys.model_requests("m")
    r.xgroup_create(stream, COORDINATOR_GROUP, id="0", mkstream=True)
    r.sadd(keys.model_coordinators("m"), "c1")
    env = child_env(as_role("client"))
    argv = ["submit", "--model", "m", "--prompt", "hi", "--json", "--timeout", "60"]
    cmd = [sys.executable, "-m", "kvq", *argv]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0, before = time.monotonic(), _lost_checks(r)

    def checked() -> bool:  # over 5 s of silence, and its lost check ran (XINFO GROUPS)
        slots = SlotState(model="m", busy=1, total=1, ts_ms=int(time.time() * 1000))
        r.hset(keys.coord_slots("c1"), mapping=slots.to_hash())  # a live coordinator, busy
        assert p.poll() is None, p.communicate()
        return time.monotonic() - t0 > client.LOST_AFTER_S + 1 and _lost_checks(r) > before

    try:
        wait_for(checked, 30, "kvq submit's lost check")
        ((_, ((entry, _),)),) = r.xreadgroup(COORDINATOR_GROUP, "c1", {stream: ">"}, count=1)
        fields = r.xrange(stream, entry, entry)[0][1]
        rid = wire.decode(fields, wire.Request).request_id
        _answer(r, keys, rid, entry.decode(), stream)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err.decode()
    assert b"NOPERM" not in err and denials(r, settings.prefix) == []


def _lost_checks(r: redis.Redis) -> int:
    stats = r.info("commandstats").get("cmdstat_xinfo|groups", {})
    return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0


def test_kvq_api_with_a_key_limit_under_the_client_user_says_which_user_it_needs(
    settings: Settings, as_role: RoleSettings
) -> None:
    env = child_env(
        as_role("client"), api_port=free_port(), api_keys="key-aaaaaaaa-1", api_key_rpm=2
    )
    cmd = [sys.executable, "-m", "kvq", "api"]
    got = subprocess.run(cmd, env=env, capture_output=True, timeout=60, cwd=Path.cwd())
    err = got.stderr.decode()
    assert got.returncode == 2, err
    assert "kvq acl --role api" in err and len(err.strip().splitlines()) == 1, err
