"""Bank.forward: the same bits as kvq.model.expert_forward whatever is hot or cold, close to
the float64 reference, counted on the device; the hot set from a histogram and the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bank_helpers import DEVICE, make_slice, opts, per_expert, routes, same

from kvq.bank import Bank, BankOptions, Histogram, table
from kvq.bank.options import GIB, resolve_budget
from kvq.errors import BankError
from kvq.model import ExpertSlice, expert_forward, expert_forward_reference


def sub(sl: ExpertSlice, a: int, b: int) -> ExpertSlice:
    """Experts [a, b) of `sl` (global ids), as the coordinator's per-slice view."""
    i, j = a - sl.expert_start, b - sl.expert_start
    return ExpertSlice(sl.layer, a, b, sl.gate[i:j], sl.up[i:j], sl.down[i:j])


@pytest.mark.parametrize("hot_experts", [0, 3, 8])
@pytest.mark.parametrize("cold_path", ["mapped", "staged"])
def test_forward_is_expert_forward(device: torch.device, hot_experts: int, cold_path: str) -> None:
    sl = make_slice(layer=2, start=0, end=8)
    bank = Bank([sl], opts(hot_bytes=hot_experts * per_expert(sl), cold_path=cold_path), device)
    assert sum(map(len, bank.hot_set().values())) == hot_experts
    assert bank.cold_path == cold_path
    ref_sl = sl.to(device)
    for seed in range(3):
        ids, w = routes(13, 3, 0, 8, seed, device)
        x = torch.randn(13, 32, generator=torch.Generator().manual_seed(seed)).to(device)
        assert same(bank.forward(2, x, ids, w), expert_forward(ref_sl, x, ids, w))


def test_forward_matches_float64_reference(device: torch.device) -> None:
    sl = make_slice(start=4, end=10)
    bank = Bank([sl], opts(hot_bytes=2 * per_expert(sl)), device)
    ids, w = routes(9, 2, 4, 10, 1)
    x = torch.randn(9, 32)
    y = bank.forward(0, x.to(device), ids.to(device), w.to(device)).cpu().numpy()
    ref = expert_forward_reference(sl.gate, sl.up, sl.down, 4, x, ids, w)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_sub_range_is_the_slice_view(device: torch.device) -> None:
    """The coordinator computes one dispatch slice at a time: same bits as that slice alone."""
    sl = make_slice(start=0, end=12, seed=3)
    bank = Bank([sl], opts(hot_bytes=5 * per_expert(sl)), device)
    ids, w = routes(16, 4, 0, 12, 2, device)
    x = torch.randn(16, 32).to(device)
    total = torch.zeros_like(x)
    for a, b in ((0, 4), (4, 8), (8, 12)):
        part = bank.forward(0, x, ids, w, a, b)
        assert same(part, expert_forward(sub(sl, a, b).to(device), x, ids, w))
        total += part
    assert torch.allclose(total, bank.forward(0, x, ids, w), atol=1e-5)


def test_worker_slice_with_several_layers(device: torch.device) -> None:
    """A worker's bank: layers 1-2, experts [4, 8); ids outside contribute 0."""
    sls = [make_slice(layer=i, start=4, end=8) for i in (1, 2)]
    bank = Bank(sls, opts(hot_bytes=3 * per_expert(sls[0])), device)
    assert bank.layers == [1, 2] and bank.expert_range(1) == (4, 8)
    ids, w = routes(10, 3, 0, 10, 5, device)
    x = torch.randn(10, 32).to(device)
    for sl in sls:
        assert same(bank.forward(sl.layer, x, ids, w), expert_forward(sl.to(device), x, ids, w))


def test_bfloat16_and_empty_rows(device: torch.device) -> None:
    sl = make_slice(dtype=torch.bfloat16)
    bank = Bank([sl], opts(hot_bytes=4 * per_expert(sl)), device)
    ids, w = routes(6, 2, 0, 8, 0, device)
    x = torch.randn(6, 32).to(device)
    y = bank.forward(0, x, ids, w)
    assert y.dtype == torch.float32
    assert same(y, expert_forward(sl.to(device), x, ids, w), cuda_rtol=2e-2)  # bf16 ulps
    none = torch.full((3, 2), 99, dtype=torch.int64, device=device)
    assert bank.forward(0, x[:3], none, w[:3]).abs().sum() == 0


@pytest.mark.parametrize(
    ("layer", "x_shape", "ids_dtype", "rng", "match"),
    [
        (5, (4, 32), torch.int64, (None, None), "holds layers \\[0\\], not layer 5"),
        (0, (4, 31), torch.int64, (None, None), "expected \\[tokens, 32\\]"),
        (0, (4, 32), torch.int32, (None, None), "int64"),
        (0, (4, 32), torch.int64, (2, 9), "not inside this bank's \\[0, 8\\)"),
        (0, (4, 32), torch.int64, (3, 3), "not inside"),
    ],
)
def test_forward_errors(
    layer: int,
    x_shape: tuple[int, int],
    ids_dtype: torch.dtype,
    rng: tuple[int | None, int | None],
    match: str,
) -> None:
    bank = Bank([make_slice()], opts())
    ids, w = routes(4, 2, 0, 8)
    with pytest.raises(BankError, match=match):
        bank.forward(layer, torch.randn(*x_shape), ids.to(ids_dtype), w, *rng)


def test_inputs_on_another_device_are_refused() -> None:
    bank = Bank([make_slice()], opts())
    ids, w = routes(2, 2, 0, 8)
    with pytest.raises(BankError, match="this bank computes on cpu"):
        bank.forward(0, torch.randn(2, 32, device="meta"), ids, w)


def test_counts_follow_forward_and_observe(device: torch.device) -> None:
    sl = make_slice(start=2, end=6)
    bank = Bank([sl], opts(hot_bytes=2 * per_expert(sl)), device)
    ids = torch.tensor([[2, 3], [3, 9], [5, 0]], device=device)
    bank.forward(0, torch.randn(3, 32, device=device), ids, torch.ones(3, 2, device=device))
    bank.observe(0, torch.tensor([[4, 4]], device=device))
    hot = set(bank.hot_set()[0])
    st = bank.stats()
    routed_hot = sum(1 for e in (2, 3, 3, 5, 4, 4) if e in hot)
    assert st["rates"].routed == 6
    assert bank.hit_rates() == pytest.approx((routed_hot / 6, 1 - routed_hot / 6))


def test_sub_range_forward_counts_only_its_range() -> None:
    bank = Bank([make_slice()], opts())
    ids = torch.tensor([[0, 5], [1, 6]])
    bank.forward(0, torch.randn(2, 32), ids, torch.ones(2, 2), 0, 4)
    assert bank.stats()["rates"].routed == 2


def test_hot_set_from_histogram() -> None:
    sls = [make_slice(layer=i, start=4, end=8) for i in (0, 1)]
    hist = Histogram(
        "m",
        [
            table(0, [0, 0, 0, 0, 1, 50, 2, 3], [1] * 8),
            table(1, [9, 9, 9, 9, 40, 0, 30, 1], [1] * 8),
        ],
    )
    bank = Bank(sls, opts(hot_bytes=3 * per_expert(sls[0])), hist=hist)
    assert bank.hot_set() == {0: [5], 1: [4, 6]}  # global ids; sizes are resident bytes
    assert bank.hot_bytes == 3 * per_expert(sls[0])
    assert bank.cold_bytes == 8 * per_expert(sls[0])


def test_histogram_with_too_few_experts() -> None:
    hist = Histogram("m", [table(0, [1, 2], [1, 1])])
    with pytest.raises(BankError, match="histogram layer 0 has 2 experts"):
        Bank([make_slice()], opts(), hist=hist)


def test_no_histogram_spreads_the_budget_over_layers() -> None:
    sls = [make_slice(layer=i) for i in range(3)]
    bank = Bank(sls, opts(hot_bytes=6 * per_expert(sls[0])))
    assert bank.hot_set() == {0: [0, 1], 1: [0, 1], 2: [0, 1]}


def test_budget_rules() -> None:
    o = BankOptions(hot_bytes=None, vram_reserve_bytes=2 * GIB)
    assert resolve_budget(o, 100, 10 * GIB, None)[0] == 100  # stock: everything that fits
    assert resolve_budget(o, 5 * GIB, 4 * GIB, None)[0] == 2 * GIB  # ... beside the reserve
    assert resolve_budget(o, 5 * GIB, 1 * GIB, None)[0] == 0
    assert resolve_budget(o, 5 * GIB, 4 * GIB, 3 * GIB)[0] == 3 * GIB  # caller's stock bytes
    assert resolve_budget(o, 100, 10 * GIB, None, accelerator=False)[0] == 0  # CPU: all cold
    assert resolve_budget(o, 100, 10 * GIB, 50, accelerator=False)[0] == 50
    explicit = BankOptions(hot_bytes=3 * GIB, vram_reserve_bytes=2 * GIB)
    assert resolve_budget(explicit, 10 * GIB, 8 * GIB, None) == (3 * GIB, "KVQ_HOT_GIB")
    assert resolve_budget(explicit, 1 * GIB, 4 * GIB, None)[0] == 1 * GIB  # capped at the bank
    with pytest.raises(BankError, match="KVQ_HOT_GIB asks for 3.000 GiB"):
        resolve_budget(explicit, 10 * GIB, 4 * GIB, None)


def test_budget_overflow_refuses_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    sl = make_slice()
    monkeypatch.setattr("kvq.bank.layout.device_free_bytes", lambda d: 3 * per_expert(sl))
    with pytest.raises(BankError, match="KVQ_HOT_GIB"):
        Bank([sl], opts(hot_bytes=4 * per_expert(sl)))
    assert Bank([sl], opts(hot_bytes=3 * per_expert(sl))).hot_bytes == 3 * per_expert(sl)
    assert Bank([sl], opts()).hot_bytes == 0  # unset on CPU: no accelerator, all cold
    assert Bank([sl], opts(), stock_hot_bytes=2 * per_expert(sl)).hot_bytes == 2 * per_expert(sl)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"dyn_steps": 0}, "dyn_steps"),
        ({"dyn_margin": 0.9}, "dyn_margin"),
        ({"dyn_margin": float("nan")}, "dyn_margin"),
        ({"numa_policy": "x"}, "numa_policy"),
        ({"cold_path": "x"}, "cold_path"),
        ({"hot_bytes": -1}, "hot_bytes"),
        ({"dyn_max_swaps": 0}, "dyn_max_swaps"),
    ],
)
def test_options_are_validated(kw: dict[str, object], name: str) -> None:
    with pytest.raises(BankError, match=name):
        BankOptions(**kw)  # type: ignore[arg-type]


def test_empty_bank_is_an_error() -> None:
    with pytest.raises(BankError, match="at least one"):
        Bank([], opts())


def test_build_logs_what_it_chose(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvq.bank"):
        Bank([make_slice()], opts(hot_bytes=2 * per_expert(make_slice())))
    text = caplog.text
    assert "cold path measured" in text and "CPU: both banks are RAM" in text
    assert "hot budget" in text and "numa: off" in text


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA only (BANK_TEST_DEVICE=cuda)")
def test_counting_never_syncs_with_the_host(device: torch.device) -> None:
    sl = make_slice()
    bank = Bank([sl], opts(hot_bytes=2 * per_expert(sl)), device)
    ids, _ = routes(64, 4, 0, 8, 0, device)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            bank.observe(0, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bank.stats()["rates"].routed == 3 * 64 * 4


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA only (BANK_TEST_DEVICE=cuda)")
def test_mapped_cold_experts_are_read_in_place(device: torch.device) -> None:
    sl = make_slice()
    bank = Bank([sl], opts(hot_bytes=0, cold_path="mapped"), device)
    st = bank._stores[0]
    assert st.cold[0].is_pinned() and st.cold_in_place is not None
    view = st.cold_in_place[0]
    assert view.device.type == "cuda" and view.data_ptr() == st.cold[0].data_ptr()
