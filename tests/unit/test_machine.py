"""`kvq.machine`: the CPU list text round-trips, and malformed text reads as unknown."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvq.machine import cpus, cpus_text, machine_id, parse_cpus


def test_cpu_lists_read_like_taskset() -> None:
    assert cpus_text({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpus_text(set()) == ""
    assert parse_cpus("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


@given(st.sets(st.integers(0, 300)))
def test_cpu_lists_round_trip(ids: set[int]) -> None:
    assert parse_cpus(cpus_text(ids)) == ids


def test_malformed_cpu_lists_are_unknown() -> None:
    for bad in ("x", "3-1", "-1", "1-", "0-999999", "1,,a"):
        assert parse_cpus(bad) == frozenset(), bad


def test_this_process() -> None:
    assert cpus() and all(c >= 0 for c in cpus())
    assert machine_id() == machine_id()
