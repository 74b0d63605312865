"""The board owns every hash record, TTL and liveness rule: no other module touches them.

Parsed, not grepped as text, so comments and docstrings may still talk about fields. Outside
`kvq/bus/` (the board, its records and the streams) no module may:
- send a hash or TTL command (`hget`, `hset`, `expire`, `set(..., px=)` ...);
- build the key of a board record (`model_state`, `worker_heartbeat`, `coord_slots` ...): a role
  that holds such a key is one step from reading its fields;
- check a key's existence (the worker liveness rule is "its heartbeat key exists");
- read a setting a TTL or liveness rule derives from (`heartbeat_ttl_s`, `slot_state_stale_s`,
  `request_ttl_s`) instead of asking `Lifetimes`;
- spell a record field the way raw Redis replies spell it (a bytes literal such as b"ts_ms"),
  or the record fields that only exist in Redis (`ts_ms`, `last_serve_ms`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

import kvq
from kvq.bus import records

ROOT = Path(kvq.__file__).parent
OWNER = ROOT / "bus"
CONFIG = ROOT / "config.py"  # defines the settings the rules derive from
# the embedded-server launcher and the benchmarks' raw-redis baselines are not roles
EXEMPT = {ROOT / "local" / "server.py", ROOT / "bench" / "bus.py"}

HASH_AND_TTL = {
    "hget",
    "hset",
    "hgetall",
    "hmget",
    "hmset",
    "hkeys",
    "hvals",
    "hlen",
    "hincrby",
    "hincrbyfloat",
    "hexists",
    "hdel",
    "hsetnx",
    "hscan",
    "expire",
    "pexpire",
    "expireat",
    "pexpireat",
    "ttl",
    "pttl",
    "persist",
    "setex",
    "psetex",
    "exists",
    "sadd",
    "srem",
    "smembers",
    "sismember",
}
RECORD_KEYS = {
    "models",
    "model_meta",
    "model_slices",
    "model_target",
    "model_coverage",
    "model_workers",
    "model_coordinators",
    "model_state",
    "worker_heartbeat",
    "worker_info",
    "coord_slots",
    "coord_stats",
}
RULE_SETTINGS = {"heartbeat_ttl_s", "slot_state_stale_s", "request_ttl_s"}
REDIS_ONLY_FIELDS = {"ts_ms", "last_serve_ms"}


def record_fields() -> set[str]:
    out: set[str] = set()
    for obj in vars(records).values():
        if (
            isinstance(obj, type)
            and issubclass(obj, records.HashCodec)
            and issubclass(obj, msgspec.Struct)
        ):
            out |= set(obj.fields())
    return out


def role_modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if OWNER not in p.parents and p not in EXEMPT]


def violations(path: Path) -> list[str]:
    fields = record_fields()
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in HASH_AND_TTL:
                out.append(f"{where}: .{name}() — ask the board")
            receiver = ast.unparse(node.func.value)
            if name in RECORD_KEYS and (receiver == "k" or receiver.endswith("keys")):
                out.append(f"{where}: key of a board record .{name}()")
            if name == "set" and any(k.arg in ("px", "ex") for k in node.keywords):
                out.append(f"{where}: a key with a TTL — the board owns lifetimes")
        elif isinstance(node, ast.Attribute) and node.attr in RULE_SETTINGS and path != CONFIG:
            out.append(f"{where}: .{node.attr} — the rule lives in kvq.bus.records.Lifetimes")
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bytes) and v.decode(errors="replace") in fields:
                out.append(f"{where}: raw hash field {v!r}")
            if isinstance(v, str) and v in REDIS_ONLY_FIELDS:
                out.append(f"{where}: hash field {v!r}")
    return out


def test_the_rules_see_the_records() -> None:
    fields = record_fields()
    assert {"ts_ms", "last_serve_ms", "saturated", "effective_target", "source"} <= fields


@pytest.mark.parametrize("path", role_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_role_touches_a_board_record(path: Path) -> None:
    assert violations(path) == []


def test_the_check_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(r, k, s):\n"
        "    r.hget(k.worker_info('w'), 'last_serve_ms')\n"
        "    board.model_state('m')\n"
        "    r.set(k.worker_heartbeat('w'), 1, px=100)\n"
        "    r.exists('x')\n"
        "    return s.heartbeat_ttl_s, {b'saturated': 1}\n"
    )
    found = violations(bad)
    assert len(found) == 8, found
