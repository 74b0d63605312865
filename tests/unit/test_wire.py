"""kvq.wire: round trips of every message, and every decoding failure is a WireError."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvq import wire
from kvq.errors import WireError
from kvq.wire import Failure, Job, ReplyEvent, Request, Result, Tensor

FAST = settings(deadline=None, database=None, max_examples=40)
FUZZ = settings(deadline=None, database=None, max_examples=100)

MSG_TYPES = [Job, Result, Request, ReplyEvent]
DTYPES = ["float32", "float16", "int32", "int64", "uint8"]
U64 = 2**64 - 1

# -- strategies ----------------------------------------------------------------------------
names = st.text(min_size=1, max_size=24)
nonneg = st.integers(0, U64)
failures = st.builds(
    Failure, type=st.text(max_size=20), message=st.text(max_size=40), retryable=st.booleans()
)


def arrays(dtype: str, shape: Any) -> st.SearchStrategy[np.ndarray]:
    """Arrays of `dtype` with any values (NaN and inf included for floats)."""
    return hnp.arrays(np.dtype(dtype), shape)


@st.composite
def tensors(draw: st.DrawFn, shape: Any = None) -> Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    if shape is None:
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))
    return Tensor.of(draw(arrays(dtype, shape)))


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    t, h, k = draw(st.integers(0, 5)), draw(st.integers(0, 6)), draw(st.integers(0, 4))
    start = draw(st.integers(0, 2**32))
    return Job(
        job_id=draw(names),
        model=draw(names),
        layer=draw(nonneg),
        slice=draw(names),
        expert_start=start,
        expert_end=start + draw(st.integers(1, 64)),
        coord=draw(names),
        reply_to=draw(names),
        deadline_ms=draw(nonneg),
        x=draw(tensors((t, h))),
        ids=draw(tensors((t, k))),
        weights=draw(tensors((t, k))),
    )


results = st.builds(
    Result,
    job_id=names,
    worker=names,
    compute_ms=st.floats(allow_nan=False),  # NaN != NaN would break struct equality
    y=st.none() | tensors(),
    error=st.none() | failures,
)
requests = st.builds(
    Request,
    request_id=names,
    model=names,
    prompt=st.none() | st.text(max_size=200),
    prompt_ids=st.none() | st.lists(nonneg, max_size=20),
    max_tokens=st.integers(1, U64),
)
replies = st.builds(
    ReplyEvent,
    kind=st.sampled_from(["token", "done", "error"]),
    index=nonneg,
    token_id=st.none() | st.integers(-(2**63), U64),
    text=st.text(max_size=50),
    finish=st.none() | st.text(max_size=10),
    error=st.none() | failures,
)
messages = st.one_of(jobs(), results, requests, replies)

# any msgpack-encodable value, nested
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(st.text(max_size=12) | st.integers(-5, 5), kids, max_size=5)
    ),
    max_leaves=20,
)


@st.composite
def near_valid_maps(draw: st.DrawFn, cls: type) -> dict[str, Any]:
    """Maps keyed (mostly) by the fields of `cls`, with arbitrary or tensor-like values."""
    fields = list(cls.__struct_fields__)
    tensorish = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from([*DTYPES, "bool"]),
            "shape": st.lists(st.integers(-2, U64) | st.integers(0, 4), max_size=6),
            "data": st.binary(max_size=64),
        }
    )
    return draw(
        st.dictionaries(st.sampled_from([*fields, "zz"]), values | tensorish, max_size=len(fields))
    )


def to_map(msg: Any) -> dict[str, Any]:
    """A message as a plain dict, bytes kept as bytes."""
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def valid_job(**tensor_overrides: Any) -> Job:
    t = {
        "x": Tensor.of(np.zeros((2, 3), np.float32)),
        "ids": Tensor.of(np.zeros((2, 2), np.int32)),
        "weights": Tensor.of(np.ones((2, 2), np.float32)),
    } | tensor_overrides
    return Job(
        job_id="j1",
        model="m",
        layer=3,
        slice="L003-004:E0000-0004",
        expert_start=0,
        expert_end=4,
        coord="c1",
        reply_to="r",
        deadline_ms=100,
        **t,
    )


def assert_same_messages(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a == b  # struct equality: tensors compare their raw bytes exactly


# -- round trips ---------------------------------------------------------------------------
@FAST
@given(messages)
def test_pack_unpack_round_trip(msg: Any) -> None:
    assert_same_messages(wire.unpack(wire.pack(msg), type(msg)), msg)


@FAST
@given(messages)
def test_encode_decode_round_trip(msg: Any) -> None:
    fields = wire.encode(msg)
    assert fields.get("t", wire._NAMES[type(msg)]) == wire._NAMES[type(msg)]
    assert isinstance(fields["m"], bytes)
    assert_same_messages(wire.decode(fields, type(msg)), msg)
    # as redis-py hands them back: bytes keys and bytes values
    raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    assert_same_messages(wire.decode(raw, type(msg)), msg)


@FAST
@given(jobs())
def test_job_tensors_survive_exactly(job: Job) -> None:
    back = wire.unpack(wire.pack(job), Job)
    for name in ("x", "ids", "weights"):
        sent, got = getattr(job, name).array(), getattr(back, name).array()
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == sent.tobytes()


@FAST
@given(requests)
def test_request_fields_are_readable(req: Request) -> None:
    fields = wire.encode(req)
    assert set(fields) == {"t", "m", "request_id", "model", "max_tokens"}
    assert fields["t"] == "request"
    assert fields["request_id"] == req.request_id
    assert fields["model"] == req.model
    assert fields["max_tokens"] == str(req.max_tokens)


@FAST
@given(replies)
def test_reply_fields_are_readable(ev: ReplyEvent) -> None:
    fields = wire.encode(ev)
    assert set(fields) == {"t", "m", "kind", "index", "text"}
    assert fields["t"] == "reply"
    assert (fields["kind"], fields["index"], fields["text"]) == (ev.kind, str(ev.index), ev.text)


@FAST
@given(st.one_of(jobs(), results))
def test_jobs_and_results_carry_only_m(msg: Any) -> None:
    assert set(wire.encode(msg)) == {"m"}


def test_decode_reads_m_only() -> None:
    req = Request(request_id="r1", model="m")
    fields = wire.encode(req) | {"request_id": "forged", "max_tokens": "999"}
    assert wire.decode(fields, Request) == req


# -- Tensor --------------------------------------------------------------------------------
@FAST
@given(
    st.sampled_from(DTYPES).flatmap(
        lambda d: arrays(d, hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5))
    )
)
def test_tensor_of_array_is_exact(arr: np.ndarray) -> None:
    t = Tensor.of(arr)
    assert t.dtype == arr.dtype.name
    assert t.shape == list(arr.shape)
    out = t.array()
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()
    assert not out.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_of_zero_dim_array_keeps_its_shape(dtype: str) -> None:
    arr = np.array(7, dtype=dtype)
    t = Tensor.of(arr)
    assert t.shape == []
    assert t.array().shape == ()


def test_tensor_of_converts_big_endian_and_strided_arrays() -> None:
    base = np.arange(24, dtype=">f4").reshape(4, 6)
    strided = base[::2, ::3]
    t = Tensor.of(strided)
    assert t.dtype == "float32" and t.shape == [2, 2]
    np.testing.assert_array_equal(t.array(), strided)
    assert t.data == np.ascontiguousarray(strided, dtype="<f4").tobytes()


@pytest.mark.parametrize("dtype", ["bool", "float64", "complex64", "int8", "uint16"])
def test_tensor_of_rejects_unsupported_dtypes(dtype: str) -> None:
    with pytest.raises(WireError, match="cannot send dtype"):
        Tensor.of(np.zeros(3, dtype=dtype))


def test_tensor_constructor_checks_byte_count() -> None:
    with pytest.raises(ValueError, match="tensor bytes"):
        Tensor("float32", [2, 2], b"\x00" * 15)


# -- fuzz: anything undecodable is a WireError -----------------------------------------------
@FUZZ
@given(st.binary(max_size=200), st.sampled_from(MSG_TYPES))
def test_unpack_arbitrary_bytes(raw: bytes, cls: type) -> None:
    try:
        got = wire.unpack(raw, cls)
    except WireError:
        return
    assert isinstance(got, cls)


@FUZZ
@given(values, st.sampled_from(MSG_TYPES))
def test_unpack_arbitrary_msgpack_values(value: Any, cls: type) -> None:
    try:
        got = wire.unpack(msgspec.msgpack.encode(value), cls)
    except WireError:
        return
    assert isinstance(got, cls)


@FUZZ
@given(st.sampled_from(MSG_TYPES).flatmap(lambda c: st.tuples(st.just(c), near_valid_maps(c))))
def test_unpack_near_valid_maps(case: tuple[type, dict[str, Any]]) -> None:
    cls, value = case
    try:
        got = wire.unpack(msgspec.msgpack.encode(value), cls)
    except WireError:
        return
    assert isinstance(got, cls)


@FUZZ
@given(messages, st.data())
def test_unpack_mutated_valid_bytes(msg: Any, data: st.DataObject) -> None:
    raw = bytearray(wire.pack(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for blob in (bytes(raw), bytes(raw[:cut])):
        try:
            wire.unpack(blob, type(msg))
        except WireError:
            pass


no_m_keys = (st.text(max_size=8) | st.binary(max_size=8)).filter(lambda k: k not in ("m", b"m"))


@FUZZ
@given(st.dictionaries(no_m_keys, values, max_size=5), st.sampled_from(MSG_TYPES))
def test_decode_without_m_field(fields: dict[Any, Any], cls: type) -> None:
    with pytest.raises(WireError, match="no msgpack field"):
        wire.decode(fields, cls)


@FUZZ
@given(
    st.sampled_from(["m", b"m"]),
    values.filter(lambda v: not isinstance(v, bytes)),
    st.sampled_from(MSG_TYPES),
)
def test_decode_with_non_bytes_m(key: Any, m: Any, cls: type) -> None:
    with pytest.raises(WireError):
        wire.decode({key: m, "t": "job"}, cls)


@FUZZ
@given(st.one_of(scalars, st.lists(values, max_size=3)), st.sampled_from(MSG_TYPES))
def test_decode_non_mapping(fields: Any, cls: type) -> None:
    with pytest.raises(WireError):
        wire.decode(fields, cls)


@FUZZ
@given(st.binary(max_size=100), st.sampled_from(MSG_TYPES))
def test_decode_garbage_m(m: bytes, cls: type) -> None:
    try:
        got = wire.decode({b"t": b"x", b"m": m}, cls)
    except WireError:
        return
    assert isinstance(got, cls)


# -- specific rejections -------------------------------------------------------------------
@pytest.mark.parametrize(
    "msg",
    [
        valid_job(),
        Result(job_id="j", worker="w"),
        Request(request_id="r", model="m"),
        ReplyEvent(kind="done"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_wrong_version_names_the_field(msg: Any) -> None:
    bad = to_map(msg) | {"v": 99}
    with pytest.raises(WireError, match=r"\$\.v"):
        wire.unpack(msgspec.msgpack.encode(bad), type(msg))


def test_tensor_byte_count_mismatch() -> None:
    bad = to_map(valid_job())
    bad["x"]["data"] = bad["x"]["data"][:-1]
    with pytest.raises(WireError, match="tensor bytes"):
        wire.unpack(msgspec.msgpack.encode(bad), Job)


def test_result_tensor_byte_count_mismatch() -> None:
    bad = {"job_id": "j", "worker": "w", "y": {"dtype": "int64", "shape": [3], "data": b"\0" * 23}}
    with pytest.raises(WireError, match="tensor bytes"):
        wire.unpack(msgspec.msgpack.encode(bad), Result)


@pytest.mark.parametrize(
    "overrides",
    [
        {"weights": Tensor.of(np.ones((2, 3), np.float32))},  # ids [2,2] vs weights [2,3]
        {"ids": Tensor.of(np.zeros((2, 3), np.int32))},  # ids [2,3] vs weights [2,2]
        {
            "ids": Tensor.of(np.zeros((3, 2), np.int32)),
            "weights": Tensor.of(np.ones((3, 2), np.float32)),
        },  # T differs from x
        {"x": Tensor.of(np.zeros(6, np.float32))},  # x not 2-D
        {
            "ids": Tensor.of(np.zeros((2, 2, 1), np.int32)),
            "weights": Tensor.of(np.ones((2, 2, 1), np.float32)),
        },  # 3-D ids
    ],
    ids=["weights-k", "ids-k", "T", "x-1d", "ids-3d"],
)
def test_job_shape_disagreement(overrides: dict[str, Tensor]) -> None:
    good = to_map(valid_job())
    bad = good | {k: to_map(v) for k, v in overrides.items()}
    with pytest.raises(WireError, match="do not agree"):
        wire.unpack(msgspec.msgpack.encode(bad), Job)


def test_job_empty_expert_range() -> None:
    bad = to_map(valid_job()) | {"expert_start": 4, "expert_end": 4}
    with pytest.raises(WireError, match="empty expert range"):
        wire.unpack(msgspec.msgpack.encode(bad), Job)


@pytest.mark.parametrize(
    "msg",
    [
        valid_job(),
        Result(job_id="j", worker="w", error=Failure("E", "boom")),
        Request(request_id="r", model="m"),
        ReplyEvent(kind="token"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_unknown_field(msg: Any) -> None:
    bad = to_map(msg) | {"surprise": 1}
    with pytest.raises(WireError, match="surprise"):
        wire.unpack(msgspec.msgpack.encode(bad), type(msg))


def test_unknown_field_inside_tensor_and_failure() -> None:
    job = to_map(valid_job())
    job["x"]["extra"] = 1
    with pytest.raises(WireError, match="extra"):
        wire.unpack(msgspec.msgpack.encode(job), Job)
    res = {"job_id": "j", "worker": "w", "error": {"type": "E", "message": "m", "oops": True}}
    with pytest.raises(WireError, match="oops"):
        wire.unpack(msgspec.msgpack.encode(res), Result)


@pytest.mark.parametrize("field", ["layer", "expert_start", "deadline_ms"])
def test_negative_job_numbers(field: str) -> None:
    bad = to_map(valid_job()) | {field: -1}
    with pytest.raises(WireError, match=rf"\$\.{field}"):
        wire.unpack(msgspec.msgpack.encode(bad), Job)


@pytest.mark.parametrize(
    ("cls", "bad"),
    [
        (Request, {"request_id": "r", "model": "m", "max_tokens": 0}),
        (Request, {"request_id": "", "model": "m"}),
        (Request, {"request_id": "r", "model": "m", "prompt_ids": [1, -2]}),
        (Request, {"request_id": "r" * 513, "model": "m"}),
        (ReplyEvent, {"kind": "maybe"}),
        (ReplyEvent, {"kind": "token", "index": -1}),
        (Result, {"job_id": "j"}),  # worker missing
        (
            Result,
            {"job_id": "j", "worker": "w", "y": {"dtype": "bool", "shape": [], "data": b"\0"}},
        ),
        (
            Result,
            {
                "job_id": "j",
                "worker": "w",
                "y": {"dtype": "uint8", "shape": [1, 1, 1, 1, 1], "data": b"\0"},
            },
        ),
        (
            Result,
            {"job_id": "j", "worker": "w", "y": {"dtype": "uint8", "shape": [-1], "data": b""}},
        ),
    ],
)
def test_invalid_values(cls: type, bad: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        wire.unpack(msgspec.msgpack.encode(bad), cls)


def test_wire_error_is_not_retryable() -> None:
    with pytest.raises(WireError) as info:
        wire.unpack(b"\xc1", Job)  # 0xc1 is never valid msgpack
    assert info.value.retryable is False


def test_failure_helper() -> None:
    f = wire.failure(KeyError("k"), retryable=True)
    assert f == Failure(type="KeyError", message="'k'", retryable=True)
    res = Result(job_id="j", worker="w", error=f)
    assert wire.decode(wire.encode(res), Result).error == f


@pytest.mark.parametrize("shape", [[2**62, 0], [1 << 24, 1 << 24, 0], [0, 1 << 25], [-1, 0]])
def test_a_tensor_with_an_impossible_shape_is_a_wire_error(shape: list[int]) -> None:
    """[2^62, 0] holds no bytes, but numpy cannot make it (a coordinator that read such a
    result of a worker exited, issue 32): refused when decoded, like any other bad message."""
    y = {"dtype": "float32", "shape": shape, "data": b""}
    raw = msgspec.msgpack.encode({"v": wire.VERSION, "job_id": "j", "worker": "w", "y": y})
    with pytest.raises(WireError):
        wire.unpack(raw, Result)
    ok = msgspec.msgpack.encode(
        {
            "v": wire.VERSION,
            "job_id": "j",
            "worker": "w",
            "y": {"dtype": "float32", "shape": [3, 0], "data": b""},
        }
    )
    assert wire.unpack(ok, Result).y.array().shape == (3, 0)
