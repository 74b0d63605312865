"""Dynamic and static updates (B4-B6): schedule, swaps under the margin and the per-layer cap,
the log line, repeated planner errors, ping-pong accounting, outputs after swaps."""

from __future__ import annotations

import pytest
import torch
from bank_helpers import make_slice, opts, per_expert, routes, same

from kvq.bank import Bank, Histogram, table
from kvq.bank.dynamic import PingPong, Tally
from kvq.errors import BankError
from kvq.model import expert_forward


def _bank(dynamic: bool = True, layers: int = 1, hot: int = 2, **kw: object) -> Bank:
    sls = [make_slice(layer=i) for i in range(layers)]
    hist = Histogram("m", [table(i, [8, 7, 6, 5, 4, 3, 2, 1], [1] * 8) for i in range(layers)])
    o = opts(hot_bytes=hot * layers * per_expert(sls[0]), dynamic=dynamic, dyn_steps=10, **kw)
    return Bank(sls, o, hist=hist)


def _traffic(bank: Bank, layer: int, experts: list[int], reps: int = 1) -> None:
    ids = torch.tensor([experts] * reps, dtype=torch.int64).reshape(-1, 1)
    bank.observe(layer, ids)


def test_updates_every_dyn_steps() -> None:
    bank = _bank()
    got = [bank.step() for _ in range(35)]
    assert [i + 1 for i, r in enumerate(got) if r is not None] == [10, 20, 30]
    assert bank.step(5) is not None  # step(n) for engines that count several at once


def test_static_reports_but_never_swaps(caplog: pytest.LogCaptureFixture) -> None:
    bank = _bank(dynamic=False)
    assert bank.hot_set() == {0: [0, 1]}
    _traffic(bank, 0, [6, 7], reps=50)
    with caplog.at_level("INFO", logger="kvq.bank"):
        report = bank.step(10)
    assert report is not None and report.swaps == 0 and report.mode == "static"
    assert bank.hot_set() == {0: [0, 1]}
    assert report.rates.cold == 1.0 and report.rates.routed == 100
    assert "(static): swaps=0" in caplog.text


def test_dynamic_swaps_popular_cold_experts_in(caplog: pytest.LogCaptureFixture) -> None:
    bank = _bank()
    _traffic(bank, 0, [0, 6, 7], reps=50)
    with caplog.at_level("INFO", logger="kvq.bank"):
        report = bank.step(10)
    assert report is not None and report.swaps == 1
    assert bank.hot_set() == {0: [0, 6]}  # 7 ties with 6: the lower id wins; 0 stays
    line = [r.message for r in caplog.records if "bank update" in r.message][0]
    assert "at step 10 (dynamic): swaps=1" in line
    assert "by count hot=0.333 cold=0.667" in line and "by bytes hot=0.333" in line


def test_at_most_max_swaps_per_layer_per_update() -> None:
    bank = _bank(layers=2, hot=4, dyn_max_swaps=2)
    for layer in (0, 1):
        _traffic(bank, layer, [4, 5, 6, 7], reps=20)
    report = bank.step(10)
    assert report is not None and report.swaps == 4  # two per layer
    for ids in bank.hot_set().values():
        assert len(ids) == 4 and len(set(ids) & {4, 5, 6, 7}) == 2


def test_margin_blocks_small_gains() -> None:
    bank = _bank(dyn_margin=1.5)
    _traffic(bank, 0, [0, 1, 2], reps=10)
    _traffic(bank, 0, [2], reps=4)  # 14 vs 10: less than 1.5x
    assert bank.step(10) is not None
    assert bank.hot_set() == {0: [0, 1]}
    _traffic(bank, 0, [2], reps=40)  # decayed 7 + 40 > 1.5 x (5 + 0)
    bank.step(10)
    assert 2 in bank.hot_set()[0]


def test_outputs_stay_exact_across_updates() -> None:
    sl = make_slice()
    bank = _bank()
    ids, w = routes(12, 3, 0, 8, 4)
    x = torch.randn(12, 32)
    want = expert_forward(sl, x, ids, w)
    for i in range(6):
        _traffic(bank, 0, [(2 * i) % 8, (2 * i + 1) % 8], reps=30)
        bank.step(10)
        assert same(bank.forward(0, x, ids, w), want)
    assert bank.swaps > 0


def test_repeated_planner_errors_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    bank = _bank()

    def broken(*a: object, **k: object) -> list[tuple[int, int]]:
        raise BankError("layer 0 expert 3: score nan is not a finite count >= 0")

    monkeypatch.setattr("kvq.bank.bank.plan_swaps", broken)
    assert bank.step(10) is not None  # 1st error: logged, update skipped
    assert bank.step(10) is not None  # 2nd
    with pytest.raises(BankError, match="3 planner errors in a row.*layer 0 expert 3"):
        bank.step(10)


def test_one_good_update_resets_the_error_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvq.bank.planner import plan_swaps as real

    fail = [True, True, False, True, True]

    def flaky(*a: object, **k: object) -> list[tuple[int, int]]:
        if fail.pop(0):
            raise BankError("boom")
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr("kvq.bank.bank.plan_swaps", flaky)
    bank = _bank()
    reports = [bank.step(10) for _ in range(5)]  # 4 errors in 5, never 3 in a row: no abort
    assert all(r is not None for r in reports) and fail == []
    assert bank._errors == 2, "the good update reset the count; the two after it count anew"
    fail.append(True)
    with pytest.raises(BankError, match="3 planner errors in a row"):
        bank.step(10)  # the third in a row


def test_manual_swaps_are_validated() -> None:
    bank = _bank()
    with pytest.raises(BankError, match="hot expert out and a cold one in"):
        bank.apply_swaps(0, [(5, 6)])  # 5 is cold
    with pytest.raises(BankError, match="at most once"):
        bank.apply_swaps(0, [(0, 6), (1, 6)])
    bank.apply_swaps(0, [(0, 6), (1, 7)])
    assert bank.hot_set() == {0: [6, 7]}


def test_hit_rates_accumulate_across_updates() -> None:
    bank = _bank(dynamic=False)
    _traffic(bank, 0, [0, 1, 2, 3], reps=5)
    bank.step(10)
    _traffic(bank, 0, [0, 7], reps=5)
    assert bank.hit_rates() == pytest.approx((15 / 30, 15 / 30))
    s = bank.stats()
    assert s["updates"] == 1 and s["mode"] == "static" and s["cold_path"] in ("mapped", "staged")


def test_tally_and_pingpong_units() -> None:
    t = Tally()
    import numpy as np

    t.add(np.array([3, 1, 0, 4]), [True, False, False, True], 10)
    r = t.rates()
    assert (r.hot, r.cold, r.routed) == (7 / 8, 1 / 8, 8)
    assert Tally().rates().hot == 0.0
    pp = PingPong()
    pp.record(1, 0, [3, 5])  # 3 out, 5 in
    pp.record(3, 0, [5, 3])  # back within two updates: both flipped twice
    pp.record(9, 0, [3])
    assert pp.total == 2
