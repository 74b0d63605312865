"""kvq.keys: hash tags, prefixes, and no key literal anywhere else."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import kvq
from kvq.keys import Keys

FAST = settings(deadline=None, database=None, max_examples=100)

ids = st.from_regex(r"[A-Za-z0-9._-]{1,24}", fullmatch=True)
prefixes = st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)

# every key builder, by the hash tag it must carry
SCOPES: dict[str, str] = {
    "model_": "m",
    "worker_": "w",
    "coord_": "c",
    "request_": "r",
    "apikey_": "k",
}
GLOBAL = {"models", "deadletter", "monitor_lease", "market", "departed"}
# (scope id, second id): the first id's tag
TWO_IDS = {"worker_results", "bench_tagged", "model_grant"}


def builders() -> dict[str, Callable[..., str]]:
    def one(fn: Callable[..., str]) -> Callable[..., str]:
        return lambda keys, *ident: fn(keys, *ident, "c0")

    return {
        name: one(fn) if name in TWO_IDS else fn
        for name, fn in inspect.getmembers(Keys, inspect.isfunction)
        if not name.startswith("_") and name != "check_id"
    }


def hash_tag(key: str) -> str | None:
    """What Redis Cluster hashes: the text between the first '{' and the next '}', if any."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def test_every_builder_is_classified() -> None:
    for name in builders():
        scratch = name.startswith("bench")  # per-run benchmark streams
        assert name in GLOBAL or scratch or any(name.startswith(p) for p in SCOPES), name
    assert GLOBAL <= set(builders())


@FAST
@given(prefixes, ids)
def test_scoped_keys_share_one_hash_tag(prefix: str, ident: str) -> None:
    keys = Keys(prefix)
    for scope_prefix, tag in SCOPES.items():
        made = [fn(keys, ident) for name, fn in builders().items() if name.startswith(scope_prefix)]
        assert made, scope_prefix
        for key in made:
            assert key.startswith(prefix + ":"), key
            assert hash_tag(key) == f"{tag}:{ident}", key
            assert f"{{{tag}:{ident}}}" in key
        assert len(set(made)) == len(made)  # no two builders collide


@FAST
@given(prefixes)
def test_global_keys_have_prefix_and_no_tag(prefix: str) -> None:
    keys = Keys(prefix)
    for name in GLOBAL:
        key = getattr(keys, name)()
        assert key.startswith(prefix + ":")
        assert hash_tag(key) is None


def test_all_keys_distinct_across_scopes() -> None:
    keys = Keys("p")
    made = [fn(keys) for n, fn in builders().items() if n in GLOBAL]
    made += [fn(keys, "x") for n, fn in builders().items() if n not in GLOBAL]
    assert len(set(made)) == len(made)


def test_model_keys_differ_per_model_and_prefix() -> None:
    a, b = Keys("a"), Keys("b")
    assert a.model_target("m1") != a.model_target("m2")
    assert a.model_target("m1") != b.model_target("m1")
    assert a.model_target("m1") == "a:{m:m1}:target"
    assert a.worker_inbox("w1") == "a:{w:w1}:inbox"
    assert a.coord_slots("c1") == "a:{c:c1}:slots"
    assert a.worker_results("w1", "c1") == "a:{w:w1}:results:c1"
    assert a.request_reply("r1") == "a:{r:r1}:reply"


def test_default_prefix() -> None:
    assert Keys().models() == "kvq:models"
    assert Keys().deadletter() == "kvq:deadletter"


# -- no key literals outside kvq/keys.py ---------------------------------------------------
# a quote followed by `kvq:` and a non-space: `"kvq:models"` is a key, `"kvq: bad value"` a message
KEY_LITERAL = re.compile(r"""["']kvq:(?!\s)""")


def test_no_key_literals_outside_keys_py() -> None:
    root = Path(kvq.__file__).resolve().parent
    files = [p for p in sorted(root.rglob("*")) if p.suffix in (".py", ".lua")]
    assert any(p.suffix == ".lua" for p in files) and len(files) > 5
    offenders = []
    for path in files:
        if path == root / "keys.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if KEY_LITERAL.search(line):
                offenders.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not offenders, "key literals outside kvq/keys.py:\n" + "\n".join(offenders)


def test_key_literal_pattern() -> None:
    assert KEY_LITERAL.search('r.xadd("kvq:deadletter", f)')
    assert KEY_LITERAL.search("k = 'kvq:{m:x}:target'")
    assert not KEY_LITERAL.search('print(f"kvq: {exc}")')
    assert not KEY_LITERAL.search('"bench:kvq:inbox"')


def test_request_shards_have_their_own_tags() -> None:
    from kvq.keys import request_shard, request_streams

    keys = Keys("p")
    streams = request_streams(keys, "m", 4)
    assert streams[0] == keys.model_requests("m") == "p:{m:m}:requests"
    assert streams[1:] == ["p:{m:m#1}:requests", "p:{m:m#2}:requests", "p:{m:m#3}:requests"]
    assert len({hash_tag(s) for s in streams}) == 4
    assert request_streams(keys, "m", 1) == ["p:{m:m}:requests"]
    # stable (CRC-32, not Python's salted hash) and spread over the shards
    assert request_shard("abc", 4) == 0x352441C2 % 4
    picks = [request_shard(f"req-{i}", 4) for i in range(400)]
    assert all(60 < picks.count(i) < 140 for i in range(4))
    assert request_shard("anything", 1) == 0
