"""`ExpertServer` without Redis: results against the float64 reference, and every refusal as
an error result (never an exception out of `handle`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import BAD_JOB, DEADLINE_EXPIRED, ExpertServer
from kvq.gguf import read_meta
from kvq.model import ExpertSlice, expert_forward_reference, load_slice
from kvq.tools.synth import make_tiny

RTOL, ATOL = 1e-4, 1e-5  # float32 compute vs the float64 reference
HELD = {0: (0, 4), 1: (4, 8)}  # layer -> the expert range the server holds
NAME, MODEL = "w-test", "tiny"


@dataclass(frozen=True)
class Tiny:
    """The tiny model's path, hidden size, every layer's experts in float64, and a bank of
    the held slices."""

    path: Path
    hidden: int
    full: dict[int, ExpertSlice]  # layer -> experts [0, 8), float64 on the CPU
    bank: Bank


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = tmp_path_factory.mktemp("server") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8)
    meta = read_meta(path)
    full = {lay: load_slice(path, meta, lay, 0, 8, dtype=torch.float64) for lay in HELD}
    held = [load_slice(path, meta, lay, lo, hi) for lay, (lo, hi) in HELD.items()]
    opts = BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False)
    return Tiny(path, meta.embedding_length, full, Bank(held, opts, "cpu"))


class Clock:
    """A settable `clock_ms`."""

    def __init__(self, now_ms: float = 1_000_000.0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms


def make_server(tiny: Tiny, clock: Clock | None = None) -> ExpertServer:
    return ExpertServer(NAME, MODEL, tiny.bank, tiny.hidden, torch.float32, clock or Clock())


@pytest.fixture
def server(tiny: Tiny) -> ExpertServer:
    return make_server(tiny)


def make_job(
    x: np.ndarray,
    ids: np.ndarray,
    w: np.ndarray,
    layer: int = 0,
    lo: int = 0,
    hi: int = 4,
    **kw: Any,
) -> wire.Job:
    fields: dict[str, Any] = dict(
        job_id="j1",
        model=MODEL,
        layer=layer,
        slice="s0",
        expert_start=lo,
        expert_end=hi,
        coord="c1",
        reply_to="out",
        deadline_ms=0,
        x=wire.Tensor.of(x),
        ids=wire.Tensor.of(ids),
        weights=wire.Tensor.of(w),
    )
    return wire.Job(**(fields | kw))


def reference(tiny: Tiny, job: wire.Job) -> np.ndarray:
    """The float64 answer over experts [expert_start, expert_end) of the job's layer."""
    sl, lo, hi = tiny.full[job.layer], job.expert_start, job.expert_end
    g, u, d = (t[lo:hi].numpy() for t in (sl.gate, sl.up, sl.down))
    x, ids, w = job.x.array(), job.ids.array(), job.weights.array()
    if job.v >= 2:  # one row per (row, expert) pair inside the range, row-major: its term
        t, j = np.nonzero((ids >= lo) & (ids < hi))
        x, ids, w = x[t], ids[t, j][:, None], w[t, j][:, None]
    return expert_forward_reference(g, u, d, lo, x, ids, w)


def inputs(tiny: Tiny, ids: list[list[int]], seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    idx = np.array(ids, dtype=np.int32)  # [T, k]
    x = rng.standard_normal((idx.shape[0], tiny.hidden)).astype(np.float32)  # [T, H]
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)  # [T, k]
    return x, idx, w


def assert_serves(server: ExpertServer, tiny: Tiny, job: wire.Job) -> np.ndarray:
    res = server.handle(job)
    assert res.error is None, res.error
    assert res.y is not None and res.y.dtype == "float32"
    y = res.y.array()
    np.testing.assert_allclose(y, reference(tiny, job), rtol=RTOL, atol=ATOL)
    assert res.job_id == job.job_id and res.worker == NAME
    return y


def assert_refuses(server: ExpertServer, job: wire.Job, type_: str, says: str) -> wire.Result:
    served, last = server.served, server.last_serve_ms
    res = server.handle(job)
    assert res.y is None and res.error is not None
    assert res.error.type == type_ and says in res.error.message, res.error
    assert res.job_id == job.job_id and res.worker == NAME
    assert (server.served, server.last_serve_ms) == (served, last), "errors are not serves"
    return res


# -- served jobs ---------------------------------------------------------------------------
def test_good_job_matches_reference_and_counts(tiny: Tiny) -> None:
    clock = Clock(5_000.0)
    server = make_server(tiny, clock)
    x, ids, w = inputs(tiny, [[0, 5], [3, 1], [6, 7], [2, 2]])
    job = make_job(x, ids, w, deadline_ms=6_000)
    res = server.handle(job)
    assert res.error is None and res.y is not None and res.worker == NAME
    assert res.compute_ms > 0
    y = res.y.array()
    np.testing.assert_allclose(y, reference(tiny, job), rtol=RTOL, atol=ATOL)
    assert y.shape == (5, tiny.hidden), "one row per pair inside [0, 4); row 2 has none"
    assert (np.abs(y).max(axis=1) > 0).all()
    assert (server.served, server.last_serve_ms) == (1, 5_000)
    clock.now_ms = 5_500.0
    only_inside = server.handle(make_job(x[:1], ids[:1, :1], w[:1, :1]))  # expert 0 alone
    assert only_inside.y is not None
    assert np.array_equal(y[:1], only_inside.y.array()), "a term's bits do not depend on its job"
    assert (server.served, server.last_serve_ms) == (2, 5_500)


def test_a_v1_job_is_answered_with_each_rows_sum(server: ExpertServer, tiny: Tiny) -> None:
    """A coordinator that predates per-pair terms gets the sum over the range per row."""
    x, ids, w = inputs(tiny, [[0, 5], [3, 1], [6, 7]])
    y = assert_serves(server, tiny, make_job(x, ids, w, v=1))
    assert y.shape == (3, tiny.hidden) and np.all(y[2] == 0)


def test_second_layer_is_served_from_its_own_range(server: ExpertServer, tiny: Tiny) -> None:
    x, ids, w = inputs(tiny, [[4, 0], [7, 5], [1, 2]], seed=1)
    y = assert_serves(server, tiny, make_job(x, ids, w, layer=1, lo=4, hi=8))
    assert y.shape[0] == 3 and (np.abs(y).max(axis=1) > 0).all()
    assert not np.allclose(y[0], assert_serves(server, tiny, make_job(x, ids, w))[0])


@pytest.mark.parametrize(("layer", "lo", "hi"), [(0, 1, 3), (0, 3, 4), (1, 6, 8), (1, 4, 5)])
def test_sub_range_of_the_held_range(
    server: ExpertServer, tiny: Tiny, layer: int, lo: int, hi: int
) -> None:
    x, ids, w = inputs(tiny, [[e, (e + 1) % 8] for e in range(8)], seed=2)
    y = assert_serves(server, tiny, make_job(x, ids, w, layer=layer, lo=lo, hi=hi))
    # held experts outside the job's range give no row
    assert y.shape[0] == int(((ids >= lo) & (ids < hi)).sum())
    assert (np.abs(y).max(axis=1) > 0).all()


def test_half_precision_job_and_empty_rows(server: ExpertServer, tiny: Tiny) -> None:
    x, ids, w = inputs(tiny, [[0, 1], [2, 3]], seed=3)
    assert_serves(
        server, tiny, make_job(x.astype(np.float16), ids.astype(np.int64), w.astype(np.float16))
    )
    empty = make_job(x[:0], ids[:0], w[:0])
    assert assert_serves(server, tiny, empty).shape == (0, tiny.hidden)
    assert server.served == 2


def test_deadline_in_the_future_or_absent_is_served(tiny: Tiny) -> None:
    clock = Clock(10_000.0)
    server = make_server(tiny, clock)
    x, ids, w = inputs(tiny, [[0, 1]])
    assert_serves(server, tiny, make_job(x, ids, w, deadline_ms=10_000))  # not yet past
    clock.now_ms = 1e12
    assert_serves(server, tiny, make_job(x, ids, w, deadline_ms=0))  # 0: no deadline
    assert server.served == 2 and server.last_serve_ms == 10**12


# -- refused jobs --------------------------------------------------------------------------
def test_expired_deadline(tiny: Tiny) -> None:
    clock = Clock(10_000.0)
    server = make_server(tiny, clock)
    x, ids, w = inputs(tiny, [[0, 1]])
    assert_refuses(server, make_job(x, ids, w, deadline_ms=9_999), DEADLINE_EXPIRED, "deadline")
    clock.now_ms = 9_000.0
    assert_serves(server, tiny, make_job(x, ids, w, deadline_ms=9_999))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"model": "other"}, "for other layer 0: this server holds tiny"),
        ({"layer": 2}, "layers [0, 1]"),
        ({"layer": 1}, "not inside [4,8)"),  # layer 1 is held, but experts [4, 8) of it
        ({"expert_start": 4, "expert_end": 8}, "[4,8) are not inside [0,4)"),
        ({"expert_start": 2, "expert_end": 6}, "[2,6) are not inside [0,4)"),
        ({"expert_start": 3, "expert_end": 5}, "not inside"),
    ],
)
def test_jobs_for_what_it_does_not_hold(
    server: ExpertServer, tiny: Tiny, change: dict[str, Any], says: str
) -> None:
    x, ids, w = inputs(tiny, [[0, 1], [2, 3]])
    assert_refuses(server, make_job(x, ids, w, **change), BAD_JOB, says)


def test_hidden_size_mismatch(server: ExpertServer, tiny: Tiny) -> None:
    _, ids, w = inputs(tiny, [[0, 1], [2, 3]])
    wide = np.ones((2, tiny.hidden + 1), np.float32)
    x = wire.Tensor("float32", [2, tiny.hidden + 1], wide.tobytes())
    job = msgspec.structs.replace(make_job(wide[:, :-1], ids, w), x=x)
    assert_refuses(server, job, BAD_JOB, f"hidden size {tiny.hidden + 1} != {tiny.hidden}")


@pytest.mark.parametrize(
    ("field", "at", "value"),
    [
        ("x", (1, 5), np.nan),
        ("x", (0, 0), -np.inf),
        ("weights", (1, 0), np.inf),
        ("weights", (0, 1), np.nan),
    ],
)
def test_non_finite_inputs(
    server: ExpertServer, tiny: Tiny, field: str, at: tuple[int, int], value: float
) -> None:
    x, ids, w = inputs(tiny, [[0, 1], [2, 3]])
    (x if field == "x" else w)[at] = value
    assert_refuses(server, make_job(x, ids, w), BAD_JOB, f"{field} holds NaN or infinity")


def test_wrong_dtypes(server: ExpertServer, tiny: Tiny) -> None:
    x, ids, w = inputs(tiny, [[0, 1]])
    floats = make_job(x, ids.astype(np.float32), w)
    assert_refuses(server, floats, BAD_JOB, "expert ids must be integers")
    ints = make_job(x.astype(np.int32), ids, w)
    assert_refuses(server, ints, BAD_JOB, "must be floating point")


def test_compute_failure_is_an_error_result(
    server: ExpertServer, tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kw: object) -> torch.Tensor:
        raise RuntimeError("device lost")

    monkeypatch.setattr(server.bank, "forward", boom)
    x, ids, w = inputs(tiny, [[0, 1]])
    res = assert_refuses(server, make_job(x, ids, w), "RuntimeError", "device lost")
    assert res.error is not None and not res.error.retryable
    monkeypatch.undo()
    assert_serves(server, tiny, make_job(x, ids, w))
    assert server.served == 1


def test_error_results_survive_the_wire(server: ExpertServer, tiny: Tiny) -> None:
    x, ids, w = inputs(tiny, [[0, 1]])
    res = server.handle(make_job(x, ids, w, model="other"))
    back = wire.decode(wire.encode(res), wire.Result)
    assert back == res and back.error is not None and back.error.type == BAD_JOB


# -- properties ----------------------------------------------------------------------------
@st.composite
def jobs(draw: st.DrawFn, hidden: int) -> wire.Job:
    t, k = draw(st.integers(0, 5)), draw(st.integers(0, 4))
    layer = draw(st.sampled_from([0, 1]))
    lo = draw(st.integers(0, 7))
    hi = draw(st.integers(lo + 1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 8, (t, k)).astype(draw(st.sampled_from([np.int32, np.int64, np.uint8])))
    fdt = draw(st.sampled_from([np.float32, np.float16]))
    x = rng.standard_normal((t, hidden)).astype(fdt)  # [T, H]
    w = rng.uniform(-2.0, 2.0, (t, k)).astype(fdt)  # [T, k] (any sign: not only softmax gates)
    return make_job(x, ids, w, layer=layer, lo=lo, hi=hi)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data())
def test_handle_never_raises_and_is_right_or_refuses(tiny: Tiny, data: st.DataObject) -> None:
    job = data.draw(jobs(tiny.hidden))
    server = make_server(tiny)
    res = server.handle(job)
    held_lo, held_hi = HELD[job.layer]
    if held_lo <= job.expert_start and job.expert_end <= held_hi:
        assert res.error is None and res.y is not None, res.error
        np.testing.assert_allclose(res.y.array(), reference(tiny, job), rtol=RTOL, atol=ATOL)
        assert server.served == 1
    else:
        assert res.y is None and res.error is not None and res.error.type == BAD_JOB
        assert server.served == 0


def test_an_overflowing_output_is_an_error_not_a_result(
    server: ExpertServer, tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, ids, w = inputs(tiny, [[0, 1], [2, 3]])
    monkeypatch.setattr(
        server.bank, "forward", lambda *a, **k: torch.full((2, tiny.hidden), float("inf"))
    )
    assert_refuses(server, make_job(x, ids, w), "NonFinite", "overflowed")
    assert server.served == 0
