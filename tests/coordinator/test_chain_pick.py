"""Which holder a sequence takes for a span (H2-H5 at stage grain, X12): the cheapest, where a
holder of the following spans too saves the hops its one job spares."""

from __future__ import annotations

from kvq.coordinator.chain import cheapest_holder

HOP = 10.0


def _cost(costs: dict[str, float]):  # type: ignore[no-untyped-def]
    return lambda w: costs[w]


def test_a_holder_of_the_next_spans_too_wins_over_a_slightly_cheaper_one() -> None:
    # span 0: a holds it alone, b holds spans 0 and 1: one job instead of two
    got = cheapest_holder(["a", "b"], _cost({"a": 1.0, "b": 5.0}), HOP, None, {"a": 0, "b": 1}, {})
    assert got == "b"


def test_a_holder_much_cheaper_than_the_hop_it_saves_still_wins() -> None:
    got = cheapest_holder(["a", "b"], _cost({"a": 1.0, "b": 30.0}), HOP, None, {"a": 0, "b": 1}, {})
    assert got == "a"


def test_the_previous_spans_holder_keeps_the_sequence_at_equal_cost() -> None:
    got = cheapest_holder(["a", "b"], _cost({"a": 1.0, "b": 1.0}), HOP, "b", {"a": 0, "b": 0}, {})
    assert got == "b"


def test_ties_go_to_the_holder_with_fewer_of_this_coordinators_sequences_then_id() -> None:
    costs, runs = _cost({"a": 1.0, "b": 1.0}), {"a": 0, "b": 0}
    assert cheapest_holder(["a", "b"], costs, HOP, None, runs, {"a": 3, "b": 1}) == "b"
    assert cheapest_holder(["b", "a"], costs, HOP, None, runs, {}) == "a"
