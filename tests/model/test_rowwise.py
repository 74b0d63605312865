"""X17: the operations made batch-invariant give each row the bits it gets alone, whatever the
other rows, their count, its place among them and the thread count (`kvq.model.rowwise`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.model import rowwise
from kvq.model.layers import Gating, Rope, attn_temperature, gated, route, swiglu_oai
from kvq.model.rowwise import heads_matmul, pointwise, row_matmul
from kvq.model.threads import one_thread

SIZES = st.sampled_from([1, 2, 3, 7, 16, 31, 33, 48, 64, 100, 128, 512, 1024, 2048, 2880])
BATCH = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=40)


def _batch(row: torch.Tensor, seeds: list[int], place: int, offset: bool) -> torch.Tensor:
    """`row` [K] at `place` among rows drawn from `seeds`, maybe a view at an odd offset."""
    others = [torch.randn(row.shape[0], generator=torch.Generator().manual_seed(s)) for s in seeds]
    place = place % (len(others) + 1)
    x = torch.stack([*others[:place], row, *others[place:]])  # [N, K]
    if offset:  # the same rows, one float past an aligned start
        buf = torch.empty(x.numel() + 1)
        buf[1:] = x.flatten()
        x = buf[1:].view(x.shape)
    return x


def _is_the_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is x @ w up to float32's rounding: within 16 ulps of each term's magnitude
    (sum |x||w|) of the float64 product."""
    ref = x.double() @ w.double()
    bound = 16 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double())
    assert bool(((got.double() - ref).abs() <= bound + 1e-30).all())


@settings(max_examples=60, deadline=None)
@given(
    k=SIZES,
    m=SIZES,
    seeds=BATCH,
    place=st.integers(0, 64),
    offset=st.booleans(),
    threads=st.sampled_from([1, 2]),
)
def test_row_matmul_gives_a_row_its_bits_alone(
    k: int, m: int, seeds: list[int], place: int, offset: bool, threads: int
) -> None:
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(k * 7919 + m))
    row = torch.randn(k, generator=torch.Generator().manual_seed(m))
    with one_thread():
        alone = row_matmul(row[None], w.T)[0]
    x = _batch(row, seeds, place, offset)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = row_matmul(x, w.T)
    finally:
        torch.set_num_threads(before)
    i = place % (len(seeds) + 1)
    assert torch.equal(got[i], alone)
    _is_the_product(got, x, w.T)


@settings(max_examples=25, deadline=None)
@given(k=SIZES, m=SIZES, seeds=BATCH, place=st.integers(0, 64), offset=st.booleans())
def test_where_blocks_would_not_hold_each_row_goes_alone_and_keeps_its_bits(
    k: int, m: int, seeds: list[int], place: int, offset: bool
) -> None:
    """The fallback for a CPU whose products change a row's bits with its block (the probe
    `blocks_hold` says no): one row per call, the same bits in any batch."""
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(k * 31 + m))
    row = torch.randn(k, generator=torch.Generator().manual_seed(k))
    x = _batch(row, seeds, place, offset)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rowwise, "blocks_hold", lambda: False)
        alone = row_matmul(row[None], w.T)[0]
        got = row_matmul(x, w.T)
    assert torch.equal(got[place % (len(seeds) + 1)], alone)
    _is_the_product(got, x, w.T)


def test_the_block_probe_holds_on_the_cpus_measured() -> None:
    """On the CPU the blocks were measured on (and any where the probe agrees) they are used;
    the answer is computed once."""
    assert rowwise.blocks_hold() in (True, False)
    assert rowwise.blocks_hold.cache_info().currsize == 1


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 4),
    k=SIZES,
    m=st.sampled_from([1, 8, 33, 64]),
    seeds=BATCH,
    place=st.integers(0, 64),
)
def test_heads_matmul_gives_a_row_its_bits_alone(
    heads: int, k: int, m: int, seeds: list[int], place: int
) -> None:
    w = torch.randn(heads, k, m)
    rows = [torch.randn(k) for _ in range(heads)]
    alone = heads_matmul(torch.stack(rows)[:, None, :], w)[:, 0]  # [heads, M]
    xs = torch.stack([_batch(r, seeds, place, False) for r in rows])  # [heads, N, K]
    got = heads_matmul(xs, w)
    i = place % (len(seeds) + 1)
    assert torch.equal(got[:, i], alone)
    for h in range(heads):
        _is_the_product(got[h], xs[h], w[h])


POINTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "cos": torch.cos,
    "sin": torch.sin,
    "log": lambda t: torch.log(t.abs() + 1),
}


@settings(max_examples=60, deadline=None)
@given(
    op=st.sampled_from(sorted(POINTWISE)),
    w=st.sampled_from([1, 5, 8, 16, 33, 64, 300]),
    seeds=st.lists(st.integers(0, 2**31 - 1), max_size=200),
    place=st.integers(0, 300),
)
def test_pointwise_gives_a_row_its_bits_alone(
    op: str, w: int, seeds: list[int], place: int
) -> None:
    fn = POINTWISE[op]
    row = torch.randn(w) * 4
    alone = pointwise(fn, row[None])[0]
    x = _batch(row, seeds, place, False)
    got = pointwise(fn, x)
    assert torch.equal(got[place % (len(seeds) + 1)], alone)
    torch.testing.assert_close(got, fn(x))


@settings(max_examples=30, deadline=None)
@given(seeds=BATCH, place=st.integers(0, 64), scores=st.sampled_from(["softmax", "sigmoid"]))
def test_route_rope_and_gates_give_a_row_its_bits_alone(
    seeds: list[int], place: int, scores: str
) -> None:
    """The callers: the router's logits and scores, rope's angles, llama4's temperature and
    the gated activations, each compared with the row run alone."""
    h, e = 64, 8
    router = torch.randn(e, h)
    row = torch.randn(h)
    x = _batch(row, seeds, place, False)
    i = place % (len(seeds) + 1)
    gating = Gating(k=2, scores=scores)
    ids, w = route(router, x, gating)
    ids1, w1 = route(router, row[None], gating)
    assert torch.equal(ids[i], ids1[0]) and torch.equal(w[i], w1[0])
    assert torch.equal(gated(x, x)[i], gated(row[None], row[None])[0])
    assert torch.equal(swiglu_oai(x, x)[i], swiglu_oai(row[None], row[None])[0])
    rope = Rope(8, 10000.0, "neox")
    pos = torch.arange(x.shape[0]) * 3
    q = x.view(x.shape[0], -1, 8)  # [N, 8 heads, d 8]
    assert torch.equal(rope(q, pos)[i], rope(q[i : i + 1], pos[i : i + 1])[0])
    t = attn_temperature(pos, 4, 0.1)
    assert torch.equal(t[i], attn_temperature(pos[i : i + 1], 4, 0.1)[0])


def test_the_setting_off_gives_the_plain_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVQ_BATCH_INVARIANT=false: torch's product as it is (one call)."""
    from dataclasses import replace

    from kvq.quant import qdot

    monkeypatch.setattr(qdot, "_options", replace(qdot.options(), batch_invariant=False))
    x, w = torch.randn(9, 64), torch.randn(64, 32)
    assert torch.equal(row_matmul(x, w), x @ w)
