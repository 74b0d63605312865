"""Swaps while forwards run (B5): every output equals the reference, and a swap waits for the
forwards that still use the old slot map before it overwrites a slot."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from bank_helpers import make_slice, opts, per_expert, routes, same

from kvq.bank import Bank
from kvq.bank.store import LayerStore
from kvq.errors import BankError
from kvq.model import expert_forward

STRESS_S = 1.5


def test_every_output_is_exact_while_swaps_run(device: torch.device) -> None:
    sls = [make_slice(layer=i, end=16, hidden=64, ffn=96, seed=9) for i in range(2)]
    bank = Bank(sls, opts(hot_bytes=12 * per_expert(sls[0])), device)
    cases = []
    for seed in range(4):
        ids, w = routes(24, 4, 0, 16, seed, device)
        x = torch.randn(24, 64, generator=torch.Generator().manual_seed(seed)).to(device)
        cases.append((x, ids, w, [expert_forward(sl.to(device), x, ids, w) for sl in sls]))
    stop, errors, n_fwd = threading.Event(), [], [0]

    def forwards() -> None:
        while not stop.is_set():
            for x, ids, w, want in cases:
                for sl, ref in zip(sls, want, strict=True):
                    if not same(bank.forward(sl.layer, x, ids, w), ref):
                        errors.append((sl.layer, n_fwd[0]))
                    n_fwd[0] += 1

    def swaps() -> None:
        rnd = random.Random(0)
        while not stop.is_set():
            layer = rnd.choice([0, 1])
            hot = bank.hot_set()[layer]
            cold = sorted(set(range(16)) - set(hot))
            k = rnd.randint(1, 3)
            bank.apply_swaps(layer, list(zip(rnd.sample(hot, k), rnd.sample(cold, k), strict=True)))

    threads = [threading.Thread(target=f, daemon=True) for f in (forwards, forwards, swaps)]
    for t in threads:
        t.start()
    time.sleep(STRESS_S)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, f"{len(errors)} of {n_fwd[0]} outputs differed"
    assert bank.swaps > 20 and n_fwd[0] > 20


def test_swap_waits_for_forwards_on_the_old_map(monkeypatch: pytest.MonkeyPatch) -> None:
    sl = make_slice()
    bank = Bank([sl], opts(hot_bytes=2 * per_expert(sl)))
    assert bank.hot_set() == {0: [0, 1]}
    entered, release = threading.Event(), threading.Event()
    real = LayerStore.weights

    def slow_weights(self: LayerStore, m: object, e: int) -> object:
        entered.set()
        release.wait(10)
        return real(self, m, e)  # type: ignore[arg-type]

    monkeypatch.setattr(LayerStore, "weights", slow_weights)
    ids = torch.zeros(3, 1, dtype=torch.int64)  # every row: expert 0, which is hot (slot 0)
    x, w = torch.randn(3, 32), torch.ones(3, 1)
    want = expert_forward(sl, x, ids, w)
    out: list[torch.Tensor] = []
    fwd = threading.Thread(target=lambda: out.append(bank.forward(0, x, ids, w)))
    fwd.start()
    assert entered.wait(10)
    swap = threading.Thread(target=bank.apply_swaps, args=(0, [(0, 5)]))
    swap.start()
    time.sleep(0.2)  # time for the swap to finish, were it not blocked
    assert swap.is_alive()  # blocked: a forward still reads slot 0 through the old map
    slot0 = bank._stores[0].hot[0][0]
    assert torch.equal(slot0, sl.gate[0])  # not overwritten yet
    release.set()
    fwd.join(10)
    swap.join(10)
    assert torch.equal(out[0], want)
    assert bank.hot_set() == {0: [1, 5]} and torch.equal(slot0, sl.gate[5])


def test_a_swap_that_cannot_drain_is_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    sl = make_slice()
    bank = Bank([sl], opts(hot_bytes=2 * per_expert(sl)))
    monkeypatch.setattr("kvq.bank.bank.DRAIN_TIMEOUT_S", 0.05)
    monkeypatch.setattr(LayerStore, "drained", lambda self: False)
    with pytest.raises(BankError, match="swap abandoned"):
        bank.apply_swaps(0, [(1, 6)])
    assert bank.hot_set() == {0: [0, 1]} and bank.swaps == 0
    ids, w = routes(5, 2, 0, 8)
    x = torch.randn(5, 32)
    assert torch.equal(bank.forward(0, x, ids, w), expert_forward(sl, x, ids, w))
