"""kvq.keys: hash tags, prefixes, slice ids, and no key literal anywhere else."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq
from kvq.keys import Keys, parse_slice_id, slice_id

FAST = settings(deadline=None, database=None, max_examples=100)

ids = st.from_regex(r"[A-Za-z0-9._-]{1,24}", fullmatch=True)
prefixes = st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)

# every key builder, by the hash tag it must carry
SCOPES: dict[str, str] = {"model_": "m", "worker_": "w", "coord_": "c", "request_": "r"}
GLOBAL = {"models", "deadletter"}


def builders() -> dict[str, Callable[..., str]]:
    return {
        name: fn
        for name, fn in inspect.getmembers(Keys, inspect.isfunction)
        if not name.startswith("_")
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
        scratch = name == "bench"  # per-run benchmark streams, no hash tag needed
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
    assert a.coord_results("c1") == "a:{c:c1}:results"
    assert a.request_reply("r1") == "a:{r:r1}:reply"


def test_default_prefix() -> None:
    assert Keys().models() == "kvq:models"
    assert Keys().deadletter() == "kvq:deadletter"


# -- slice ids -----------------------------------------------------------------------------
quads = st.tuples(*(st.integers(0, 10**6) for _ in range(4)))


@FAST
@given(quads)
def test_slice_id_round_trip(q: tuple[int, int, int, int]) -> None:
    sid = slice_id(*q)
    assert parse_slice_id(sid) == q
    assert slice_id(*parse_slice_id(sid)) == sid


@FAST
@given(
    st.tuples(st.integers(0, 999), st.integers(0, 999), st.integers(0, 9999), st.integers(0, 9999)),
    st.tuples(st.integers(0, 999), st.integers(0, 999), st.integers(0, 9999), st.integers(0, 9999)),
)
def test_slice_ids_sort_like_their_numbers(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    assert (slice_id(*a) < slice_id(*b)) == (a < b)


def test_slice_id_format() -> None:
    assert slice_id(0, 1, 4, 8) == "L000-001:E0004-0008"


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "L",
        ":",
        "L000-001",
        "E0000-0004",
        "L000-001:E0000-0004:x",
        "L000-001:E0000",
        "L000:E0000-0004",
        "E000-001:L0000-0004",
        "X000-001:E0000-0004",
        "L000-001:X0000-0004",
        "Lab-001:E0000-0004",
        "L000-001:E0000-00x4",
        "L000-001-002:E0000-0004",
        "L-01-002:E0000-0004",
        "L000-001E0000-0004",
        "L000--001:E0000-0004",
        "l000-001:e0000-0004",
    ],
)
def test_parse_slice_id_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError):
        parse_slice_id(garbage)


@FAST
@given(st.text(max_size=30))
def test_parse_slice_id_raises_only_value_error(text: str) -> None:
    try:
        parse_slice_id(text)
    except ValueError:
        pass


@pytest.mark.parametrize(
    "almost", ["L1-2:E3-4", "L 001-002:E0004-0008", "L+01-002:E0004-0008", "L0_01-002:E0004-0008"]
)
def test_parse_slice_id_rejects_non_canonical_ids(almost: str) -> None:
    with pytest.raises(ValueError):
        parse_slice_id(almost)


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
