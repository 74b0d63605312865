"""The worker's memory budget (issue 10 item 4): the arithmetic and when it asks for more."""

from __future__ import annotations

import pytest
import torch

from kvq.config import load_settings
from kvq.errors import ConfigError
from kvq.worker.budget import GIB, Budget, budget_bytes, free_memory, host_available


def test_an_explicit_budget_is_taken_as_it_is() -> None:
    assert budget_bytes(2.5, 1.0, free=10) == int(2.5 * GIB), "free memory does not matter"


def test_the_auto_budget_is_free_memory_less_the_reserve() -> None:
    assert budget_bytes(0.0, 1.0, free=5 * GIB) == 4 * GIB
    assert budget_bytes(0.0, 0.0, free=123) == 123
    assert budget_bytes(0.0, 2.0, free=GIB) == 0, "less free than the reserve: nothing"
    assert budget_bytes(0.0, 1.0, free=None) is None, "unknown free memory: no limit"


def test_room_and_whether_to_ask_again() -> None:
    b = Budget(limit=1000)
    assert b.room(0) == 1000 and b.room(600) == 400 and b.room(1500) == 0
    assert b.can_take(used=999, held=5)
    assert not b.can_take(used=1000, held=1), "full: no ask (it could take nothing)"
    unlimited = Budget(limit=None)
    assert unlimited.room(10**12) is None and unlimited.can_take(10**12, 100)
    capped = Budget(limit=None, max_slices=2)
    assert capped.can_take(0, 1) and not capped.can_take(0, 2), "KVQ_WORKER_MAX_SLICES"
    one = Budget(limit=10**9, max_slices=1)
    assert one.can_take(0, 0) and not one.can_take(10, 1), "1: the old one-slice worker"


def test_the_settings_make_the_budget() -> None:
    s = load_settings(worker_memory_gib=0.5, worker_max_slices=3).worker
    b = Budget.of(s, torch.device("cpu"))
    assert b == Budget(limit=GIB // 2, max_slices=3)
    auto = Budget.of(load_settings(worker_memory_reserve_gib=0.0).worker, torch.device("cpu"))
    free = host_available()
    assert free is not None and auto.limit is not None and 0 < auto.limit
    assert free_memory(torch.device("cpu")) is not None


@pytest.mark.parametrize(
    "name,value",
    [
        ("worker_memory_gib", -1.0),
        ("worker_memory_gib", float("inf")),
        ("worker_memory_reserve_gib", -0.5),
        ("worker_max_slices", -1),
    ],
)
def test_bad_budget_settings_are_refused(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=name.upper()):
        load_settings(**{name: value})
