"""kvq.slices: slice ids, the grid, the SliceSpec and TensorRange codecs, and one owner of each."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq
from kvq.errors import ConfigError, ModelError
from kvq.slices import (
    EXPERT_KINDS,
    RANGE_KEYS,
    SliceBounds,
    SliceSpec,
    TensorRange,
    parse_slice_id,
    range_from_dict,
    range_to_dict,
    slice_grid,
    slice_id,
)
from kvq.swarm import ModelSpec

FAST = settings(deadline=None, database=None, max_examples=100)


# -- slice ids -------------------------------------------------------------------------------
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
    assert SliceBounds(0, 1, 4, 8).sid == "L000-001:E0004-0008"


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


# -- the grid --------------------------------------------------------------------------------
@FAST
@given(st.integers(0, 40), st.integers(0, 70), st.integers(1, 9), st.integers(1, 20))
def test_grid_covers_every_layer_and_expert_exactly_once(
    layers: int, experts: int, slice_layers: int, slice_experts: int
) -> None:
    grid = slice_grid(layers, experts, slice_layers, slice_experts)
    cells = Counter(
        (layer, e) for ls, le, es, ee in grid for layer in range(ls, le) for e in range(es, ee)
    )
    assert set(cells) == {(la, e) for la in range(layers) for e in range(experts)}
    assert set(cells.values()) <= {1}
    assert all(0 < b.layer_end - b.layer_start <= slice_layers for b in grid)
    assert all(0 < b.expert_end - b.expert_start <= slice_experts for b in grid)
    assert [b.sid for b in grid] == sorted(b.sid for b in grid)  # slice order is id order


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((2, 8, 0, 4), "slice_layers"),
        ((2, 8, 1, 0), "slice_experts"),
        ((-1, 8, 1, 4), "layers"),
        ((2, 8, 1, True), "slice_experts"),
        ((2, 8.0, 1, 4), "experts"),
    ],
)
def test_grid_rejects_bad_sizes(args: tuple[Any, ...], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        slice_grid(*args)


def test_swarm_models_are_cut_by_the_same_grid() -> None:
    m = ModelSpec.layered("m", layers=3, layer_gib=2.0, experts=10, experts_per_slice=4)
    assert [s.sid for s in m.slices] == [b.sid for b in slice_grid(3, 10, 1, 4)]


# -- SliceSpec and its JSON text -------------------------------------------------------------
SHA = "ab" * 32
names = st.text(max_size=12)
ints = st.integers(0, 2**62)


def _range(kind: str = "gate", offset: int = 0) -> TensorRange:
    return TensorRange(f"blk.0.ffn_{kind}_exps.weight", kind, offset, 96, 8, (4, 32))


@st.composite
def specs(draw: st.DrawFn) -> SliceSpec:
    ls, es = draw(st.integers(0, 999)), draw(st.integers(0, 9999))
    le, ee = ls + draw(st.integers(1, 4)), es + draw(st.integers(1, 64))
    n = (le - ls) * draw(st.integers(1, 3))
    ranges = draw(
        st.lists(
            st.builds(
                TensorRange,
                names,
                st.sampled_from(EXPERT_KINDS),
                ints,
                ints,
                st.integers(0, 40),
                st.lists(st.integers(0, 2**20), max_size=3).map(tuple),
            ),
            min_size=n,
            max_size=n,
        )
    )
    sums = draw(st.lists(st.from_regex(r"[0-9a-f]{64}", fullmatch=True), min_size=n, max_size=n))
    return SliceSpec(slice_id(ls, le, es, ee), ls, le, es, ee, tuple(ranges), tuple(sums))


@FAST
@given(specs())
def test_slice_spec_round_trips_through_json(spec: SliceSpec) -> None:
    text = spec.to_json()
    assert SliceSpec.from_json(spec.sid, text) == spec
    assert SliceSpec.from_json(spec.sid, text.encode()) == spec
    assert json.loads(text) == spec.to_dict()


def _two_layer_spec() -> SliceSpec:
    ranges = tuple(_range(k, 1000 * i) for i, k in enumerate(EXPERT_KINDS * 2))
    return SliceSpec("L000-002:E0000-0004", 0, 2, 0, 4, ranges, (SHA,) * 6)


def test_slice_spec_json_text_is_the_published_format() -> None:
    spec = SliceSpec("L003-004:E0004-0008", 3, 4, 4, 8, (_range(),), (SHA,))
    assert spec.to_json() == (
        '{"layers": [3, 4], "experts": [4, 8], "bytes": 96, "ranges": [{"name": '
        '"blk.0.ffn_gate_exps.weight", "kind": "gate", "offset": 0, "nbytes": 96, '
        f'"ggml_type": 8, "expert_shape": [4, 32], "sha256": "{SHA}"}}]}}'
    )


def test_ranges_of_splits_by_layer() -> None:
    spec = _two_layer_spec()
    assert list(spec.layers()) == [0, 1]
    assert [r.offset for r in spec.ranges_of(1)] == [3000, 4000, 5000]
    assert [r.kind for r in spec.ranges_of(0)] == list(EXPERT_KINDS)
    assert spec.nbytes == 6 * 96
    with pytest.raises(ModelError, match="layer 2 is not in slice"):
        spec.ranges_of(2)


def _doc() -> dict[str, Any]:
    return json.loads(_two_layer_spec().to_json())  # type: ignore[no-any-return]


def _set(path: tuple[Any, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_set(("layers",), [0]), "'layers' must be"),
        (_set(("experts",), "0-4"), "'experts' must be"),
        (_set(("layers",), [0, "2"]), "'layers' = '2' is not an int"),
        (_set(("ranges",), {}), "'ranges' must be a list"),
        (_set(("ranges", 1, "offset"), "12"), "range 1: key 'offset' = '12' is not an int"),
        (_set(("ranges", 0, "nbytes"), True), "'nbytes' = True is not an int"),
        (_set(("ranges", 0, "name"), 7), "'name' = 7 is not a str"),
        (_set(("ranges", 2, "kind"), "ffn"), "range 2: range kind 'ffn'"),
        (_set(("ranges", 0, "expert_shape"), 4), "expert_shape 4 is not a list"),
        (_set(("ranges", 0, "sha256"), "xyz"), "'sha256' = 'xyz' is not 64"),
        (_set(("ranges", 3), 5), "range 3: range 5 lacks one of"),
        (_set(("bytes",), 7), "'bytes' = 7, its ranges sum to 576"),
        (_set(("layers",), [2, 2]), "is empty"),
        (_set(("experts",), [4, 8]), "does not name layers"),
        (lambda d: d["ranges"].pop(), "5 ranges do not split evenly over layers [0, 2)"),
        (lambda d: d["ranges"][0].pop("sha256"), "'sha256' = None"),
        (lambda d: d["ranges"][0].pop("ggml_type"), "lacks one of"),
        (lambda d: d.pop("bytes"), "'bytes' = None is not an int"),
    ],
)
def test_slice_spec_from_json_names_what_is_wrong(
    edit: Callable[[dict[str, Any]], None], words: str
) -> None:
    d = _doc()
    edit(d)
    with pytest.raises(ModelError, match=re.escape(words)):
        SliceSpec.from_json("L000-002:E0000-0004", json.dumps(d))


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", b"\xff\xfe{", '"L000"'])
def test_slice_spec_from_json_refuses_non_objects(text: str | bytes) -> None:
    with pytest.raises(ModelError, match="slice 'L000-002:E0000-0004'"):
        SliceSpec.from_json("L000-002:E0000-0004", text)


# -- TensorRange as plain values -------------------------------------------------------------
def test_range_codec_round_trip_and_key_order() -> None:
    r = _range("down", 12)
    d = range_to_dict(r)
    assert tuple(d) == RANGE_KEYS
    assert range_from_dict(json.loads(json.dumps(d)), "here") == r
    assert range_from_dict({**d, "sha256": SHA}, "here") == r  # other keys are ignored


# -- one owner -------------------------------------------------------------------------------
SLICE_ID_CODE = re.compile(r"def (parse_)?slice_id\b|L\{[^}]*:03d\}|_SLICE_ID\s*=")


def test_no_other_module_formats_slice_ids() -> None:
    root = Path(kvq.__file__).resolve().parent
    files = [p for p in sorted(root.rglob("*.py")) if p != root / "slices.py"]
    assert len(files) > 5
    offenders = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SLICE_ID_CODE.search(line)
    ]
    assert not offenders, "slice ids formatted outside kvq/slices.py:\n" + "\n".join(offenders)
    assert SLICE_ID_CODE.search((root / "slices.py").read_text(encoding="utf-8"))


def test_slices_module_imports_no_torch() -> None:
    """The swarm (pure routing) imports kvq.slices; torch would cost it seconds per start."""
    code = "import sys, kvq.slices, kvq.swarm; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
