"""What each role's ACL user may not do (`kvq.security.acl`), against a real server: one case each.

A worker `a` tries what a hostile volunteer would, against a registered model, a peer `b` with
jobs in its inbox, a coordinator `c1` and a client's request `R`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from acl_helpers import RoleSettings

from kvq.bus.streams import ensure_group
from kvq.config import Settings
from kvq.keys import WORKER_GROUP, Keys
from kvq.monitor import Monitor

# (what it is, the command) — `{k}` is a Keys, `{sid}` a slice id, `{eid}` a job of b's inbox
WORKER_FORBIDDEN = {
    "read another worker's inbox": ("XRANGE", "{inbox_b}", "-", "+"),
    "steal its jobs by reading its group": (
        "XREADGROUP",
        "GROUP",
        WORKER_GROUP,
        "a",
        "STREAMS",
        "{inbox_b}",
        ">",
    ),
    "steal its jobs by claiming them": ("XCLAIM", "{inbox_b}", WORKER_GROUP, "a", "0", "{eid}"),
    "write a result as another worker": ("XADD", "{results_b}", "*", "t", "result"),
    "write a result to a coordinator stream": ("XADD", "{coord_results}", "*", "t", "result"),
    "raise demand (target)": ("HSET", "{target}", "{sid}", "99"),
    "pardon itself (quarantine)": ("HDEL", "{quarantine}", "a"),
    "read the quarantine verdicts": ("HGETALL", "{quarantine}"),
    "fake coverage": ("HINCRBY", "{coverage}", "{sid}", "-1"),
    "assign itself a slice": ("HSET", "{workers}", "a", "{sid}"),
    "delete a peer's heartbeat": ("DEL", "{hb_b}"),
    "delete the slice table": ("DEL", "{slices}"),
    "repoint meta.source": ("HSET", "{meta}", "source", "http://evil.example/x.gguf"),
    "rewrite a slice's sha256": ("HSET", "{slices}", "{sid}", '{{"sha256": "0"}}'),
    "write done into a client's reply stream": ("XADD", "{reply}", "*", "kind", "done"),
    "queue a request": ("XADD", "{requests}", "*", "t", "request"),
    "run the market script itself": ("EVAL", "return 1", "0"),
    "load a script": ("SCRIPT", "LOAD", "return 1"),
    "volunteer as another worker": ("XADD", "{asks_b}", "*", "op", "volunteer"),
    "read the answers of another worker": ("XRANGE", "{answers_b}", "-", "+"),
    "delete the dead-letter stream": ("DEL", "{deadletter}"),
    "trim every role's dead letters away": ("XADD", "{deadletter}", "MAXLEN", "0", "*", "x", "y"),
    "write a peer's dead letters": ("XADD", "{dead_b}", "*", "reason", "x"),
    "list every key": ("SCAN", "0"),
    "list keys by pattern": ("KEYS", "*"),
    "pick a random key name": ("RANDOMKEY",),
    "learn every key written": ("CLIENT", "TRACKING", "on", "BCAST"),
    "wipe the server": ("FLUSHALL",),
    "change ACL users": ("ACL", "SETUSER", "a2", "on"),
    # its own keys: only the commands of each key's type and use (no retyping, no new keys)
    "switch to another database": ("SELECT", "1"),
    "SET its record (a string for its hash)": ("SET", "{info_a}", "x"),
    "make its beat a hash": ("HSET", "{hb_a}", "f", "v"),
    "make its results a hash": ("HSET", "{results_a}", "f", "v"),
    "add jobs to its own inbox": ("XADD", "{inbox_a}", "*", "t", "job"),
    "make consumers in its inbox's group": (
        "XGROUP",
        "CREATECONSUMER",
        "{inbox_a}",
        WORKER_GROUP,
        "x",
    ),
    "write its own answers": ("XADD", "{answers_a}", "*", "slice", "s0"),
    "write a key of its own kvq does not use": ("SET", "{junk_a}", "x"),
    "keep its results forever": ("PERSIST", "{results_a}"),
    "rename its keys": ("RENAME", "{info_a}", "{junk_a}"),
}
WORKER_ALLOWED = {
    "its own inbox": ("XRANGE", "{inbox_a}", "-", "+"),
    "its own results": ("XADD", "{results_a}", "*", "t", "result"),
    "its own dead letters": ("XADD", "{dead_a}", "MAXLEN", "~", "1000", "*", "reason", "x"),
    "the model tables": ("HGETALL", "{slices}"),
    "the model list": ("SMEMBERS", "{models}"),
    "the doorbell": ("XADD", "{market}", "*", "worker", "a"),
    "its beat": ("SET", "{hb_a}", "token", "PX", "3000"),
    "its record": ("HSET", "{info_a}", "model", "tiny"),
    "leave (its keys dropped)": ("DEL", "{hb_a}", "{info_a}", "{inbox_a}", "{answers_a}"),
}
CLIENT_FORBIDDEN = {
    "take requests": ("XREADGROUP", "GROUP", "coordinators", "x", "STREAMS", "{requests}", ">"),
    "delete the request stream": ("DEL", "{requests}"),
    "post a job": ("XADD", "{inbox_b}", "*", "t", "job"),
    "write a reply": ("XADD", "{reply}", "*", "kind", "done"),
    "write the model table": ("HSET", "{meta}", "source", "x"),
    "read everyone's queued requests": ("XINFO", "STREAM", "{requests}", "FULL"),
    "read the request stream": ("XRANGE", "{requests}", "-", "+"),
    "pick a random key name": ("RANDOMKEY",),
    "learn every key written": ("CLIENT", "TRACKING", "on", "BCAST"),
    "reset an API key's call counter": ("SET", "{calls}", "0"),
    "count an API key's calls": ("INCRBY", "{calls}", "1"),
}
CLIENT_ALLOWED = {  # what kvq.client and `kvq api` do
    "queue a request": ("XADD", "{requests}", "MAXLEN", "~", "10000", "*", "t", "request"),
    "cancel one": ("XADD", "{cancel}", "*", "t", "cancel"),
    "read its reply stream": ("XREAD", "COUNT", "256", "STREAMS", "{reply}", "0-0"),
    "drop the reply stream it read": ("DEL", "{reply}"),
    "check the model is registered": ("SISMEMBER", "{models}", "tiny"),
    "list models": ("SMEMBERS", "{models}"),
    "list coordinators": ("SMEMBERS", "{coordinators}"),
    "read a coordinator's slots": ("HGETALL", "{slots}"),
    "read a coordinator's token counter": ("HGETALL", "{stats}"),
    "measure the queue": ("XLEN", "{requests}"),
    "see the queue's group lag": ("XINFO", "GROUPS", "{requests}"),
    "ping": ("PING",),
}
API_ALLOWED = {  # what `kvq api` does beyond a client: count each API key's calls
    "count an API key's calls": ("SET", "{calls}", "0", "EX", "60", "NX"),
    "count one more (redis-py's INCR)": ("INCRBY", "{calls}", "1"),
    "see the window left": ("PTTL", "{calls}"),
    "queue a request": ("XADD", "{requests}", "MAXLEN", "~", "10000", "*", "t", "request"),
}
COORD_FORBIDDEN = {
    "repoint meta.source": ("HSET", "{meta}", "source", "x"),
    "raise demand": ("HSET", "{target}", "{sid}", "99"),
    "fake coverage": ("HSET", "{coverage}", "{sid}", "9"),
    "read a worker's inbox": ("XRANGE", "{inbox_b}", "-", "+"),
    "run a script": ("EVAL", "return 1", "0"),
    "pick a random key name": ("RANDOMKEY",),
    "learn every key written": ("CLIENT", "TRACKING", "on", "BCAST"),
    "list every key": ("SCAN", "0"),
}
MONITOR_FORBIDDEN = {
    "pick a random key name": ("RANDOMKEY",),
    "learn every key written": ("CLIENT", "TRACKING", "on", "BCAST"),
    "list keys by pattern (KEYS)": ("KEYS", "*"),
    "wipe the server": ("FLUSHALL",),
}


COORD_ALLOWED = {  # a dead coordinator's requests taken over, jobs posted, results emptied
    "list the request group's consumers": ("XINFO", "CONSUMERS", "{requests}", "coordinators"),
    "count pending requests": ("XPENDING", "{requests}", "coordinators"),
    "claim them": ("XCLAIM", "{requests}", "coordinators", "c1", "0", "0-1"),
    "drop the dead consumer": ("XGROUP", "DELCONSUMER", "{requests}", "coordinators", "dead"),
    "post a job": ("XADD", "{inbox_b}", "*", "t", "job"),
    "read a worker's results": ("XREAD", "STREAMS", "{results_b}", "0-0"),
    "empty them": ("DEL", "{results_b}"),
    "read the cancels": ("XREAD", "STREAMS", "{cancel}", "0-0"),
    "write a reply": ("XADD", "{reply}", "*", "kind", "token"),
    "renew it": ("EXPIRE", "{reply}", "600"),
    "read a beat": ("EXISTS", "{hb_b}"),
    "read the assignments": ("HGETALL", "{workers}"),
    "record a quarantine verdict": ("HSET", "{quarantine}", "a", '{{"until_ms": 1}}'),
    "read the quarantine verdicts": ("HGETALL", "{quarantine}"),
}


@pytest.fixture
def world(settings: Settings, r: redis.Redis, tiny_model: Path) -> dict[str, str]:
    """A registered model, a peer worker `b` with one job pending in its inbox, a request."""
    k = Keys(settings.prefix)
    mon = Monitor.from_settings(settings)
    info = mon.register("tiny", tiny_model)
    mon.board.r.close()
    sid = sorted(info.slices)[0]
    ensure_group(r, k.worker_inbox("b"), WORKER_GROUP)
    eid = r.xadd(k.worker_inbox("b"), {"t": "job"}).decode()
    r.xreadgroup(WORKER_GROUP, "b", {k.worker_inbox("b"): ">"})
    r.set(k.worker_heartbeat("b"), "x", px=60_000)
    r.xadd(k.request_reply("R"), {"kind": "token"})
    r.xadd(k.model_requests("tiny"), {"t": "request"})
    r.xgroup_create(k.model_requests("tiny"), "coordinators", id="0")
    return {
        "sid": sid,
        "eid": eid,
        "inbox_a": k.worker_inbox("a"),
        "inbox_b": k.worker_inbox("b"),
        "results_a": k.worker_results("a", "c1"),
        "results_b": k.worker_results("b", "c1"),
        "coord_results": f"{settings.prefix}:{{c:c1}}:results",
        "target": k.model_target("tiny"),
        "coverage": k.model_coverage("tiny"),
        "workers": k.model_workers("tiny"),
        "hb_b": k.worker_heartbeat("b"),
        "slices": k.model_slices("tiny"),
        "meta": k.model_meta("tiny"),
        "reply": k.request_reply("R"),
        "requests": k.model_requests("tiny"),
        "asks_b": k.worker_asks("b"),
        "answers_b": k.worker_answers("b"),
        "deadletter": k.deadletter(),
        "models": k.models(),
        "market": k.market(),
        "cancel": k.model_cancels("tiny"),
        "coordinators": k.model_coordinators("tiny"),
        "slots": k.coord_slots("c1"),
        "stats": k.coord_stats("c1"),
        "calls": k.apikey_calls("0123456789abcdef"),
        "quarantine": k.model_quarantine("tiny"),
        "info_a": k.worker_info("a"),
        "hb_a": k.worker_heartbeat("a"),
        "answers_a": k.worker_answers("a"),
        "junk_a": f"{settings.prefix}:{{w:a}}:junk",
        "dead_a": k.worker_dead("a"),
        "dead_b": k.worker_dead("b"),
    }


def _run(s: Settings, cmd: tuple[str, ...], world: dict[str, str]) -> object:
    conn = redis.Redis.from_url(s.redis_url)
    try:
        return conn.execute_command(*[c.format(**world) for c in cmd])
    finally:
        conn.close()


@pytest.mark.parametrize("what", sorted(WORKER_FORBIDDEN))
def test_a_worker_cannot(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        _run(as_role("worker", "a"), WORKER_FORBIDDEN[what], world)


@pytest.mark.parametrize("what", sorted(WORKER_ALLOWED))
def test_a_worker_can(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    _run(as_role("worker", "a"), WORKER_ALLOWED[what], world)


@pytest.mark.parametrize("what", sorted(CLIENT_FORBIDDEN))
def test_a_client_cannot(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        _run(as_role("client"), CLIENT_FORBIDDEN[what], world)


@pytest.mark.parametrize("what", sorted(CLIENT_ALLOWED))
def test_a_client_can(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    _run(as_role("client"), CLIENT_ALLOWED[what], world)


@pytest.mark.parametrize("what", sorted(API_ALLOWED))
def test_the_api_gateway_can(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    _run(as_role("api"), API_ALLOWED[what], world)


@pytest.mark.parametrize("what", sorted(MONITOR_FORBIDDEN))
def test_a_monitor_cannot(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        _run(as_role("monitor"), MONITOR_FORBIDDEN[what], world)


@pytest.mark.parametrize("what", sorted(COORD_ALLOWED))
def test_a_coordinator_can(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    _run(as_role("coordinator"), COORD_ALLOWED[what], world)


@pytest.mark.parametrize("what", sorted(COORD_FORBIDDEN))
def test_a_coordinator_cannot(what: str, world: dict[str, str], as_role: RoleSettings) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        _run(as_role("coordinator"), COORD_FORBIDDEN[what], world)


def test_the_slice_table_is_unchanged(
    world: dict[str, str], r: redis.Redis, as_role: RoleSettings
) -> None:
    """After every forbidden write, the checksums workers verify against are the monitor's."""
    before = r.hgetall(world["slices"])
    for cmd in WORKER_FORBIDDEN.values():
        try:
            _run(as_role("worker", "a"), cmd, world)
        except redis.exceptions.NoPermissionError:
            pass
    assert r.hgetall(world["slices"]) == before
    spec = json.loads(before[world["sid"].encode()])
    assert all(len(rg["sha256"]) == 64 for rg in spec["ranges"])
