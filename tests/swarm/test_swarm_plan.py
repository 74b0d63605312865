"""kvq.swarm types and plan: slices, stages and hops, placement, validation (H1)."""

from __future__ import annotations

import math

import pytest

from kvq.errors import ConfigError, TopologyError
from kvq.slices import parse_slice_id
from kvq.swarm import CostWeights, ModelSpec, NodeProfile, Pipeline, SwarmPlan, place


def test_layered_model_cuts_layers_and_expert_ranges() -> None:
    m = ModelSpec.layered("m", layers=2, layer_gib=4.0, experts=6, experts_per_slice=4)
    assert [parse_slice_id(s.sid) for s in m.slices] == [
        (0, 1, 0, 4),
        (0, 1, 4, 6),
        (1, 2, 0, 4),
        (1, 2, 4, 6),
    ]
    assert [s.gib for s in m.slices] == pytest.approx([4 * 4 / 6, 4 * 2 / 6] * 2)
    assert sum(s.gib for s in m.slices) == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": 0}, "layers"),
        ({"experts_per_slice": 9}, "experts_per_slice"),
        ({"layer_gib": -1.0}, "layer_gib"),
    ],
)
def test_layered_model_rejects_bad_shapes(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"layers": 2, "layer_gib": 1.0, "experts": 8} | kwargs
    with pytest.raises(TopologyError, match=match):
        ModelSpec.layered("m", **args)  # type: ignore[arg-type]


def test_stages_and_hops_count_node_changes_in_slice_order() -> None:
    p = Pipeline(0, "m", ("a", "a", "b", "a", "a", "c"))
    assert p.stages == ("a", "b", "a", "c")
    assert p.hops == 3
    assert p.nodes == frozenset({"a", "b", "c"})
    assert Pipeline(1, "m", ("x",) * 5).hops == 0


def test_cost_weights_are_validated() -> None:
    assert CostWeights() == CostWeights(1.0, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="w_h"):
        CostWeights(w_h=-1.0)
    with pytest.raises(ConfigError, match="w_l"):
        CostWeights(w_l=math.nan)


def test_node_profile_is_validated() -> None:
    with pytest.raises(TopologyError, match="memory_gib"):
        NodeProfile("n", -1.0)
    with pytest.raises(TopologyError, match="non-empty"):
        NodeProfile("")


def _nodes(*mem: float) -> list[NodeProfile]:
    return [NodeProfile(f"n{i}", m, latency_ms=float(i)) for i, m in enumerate(mem)]


def test_place_respects_memory_and_spreads_copies_over_distinct_nodes() -> None:
    nodes = _nodes(8, 8, 4, 4)
    model = ModelSpec.layered("m", layers=4, layer_gib=2.0)
    pipes = place(nodes, [model], copies=2)
    assert [p.assignment for p in pipes] == [("n0",) * 4, ("n1",) * 4]
    plan = SwarmPlan({n.node_id: n for n in nodes}, {"m": model}, pipes, 2)
    assert plan.problems() == []


def test_place_splits_a_copy_when_one_node_is_too_small() -> None:
    nodes = _nodes(3, 3, 3)
    model = ModelSpec.layered("m", layers=4, layer_gib=1.0)
    (p,) = place(nodes, [model], copies=1)
    assert p.assignment == ("n0", "n0", "n0", "n1")
    assert p.hops == 1


def test_place_gives_fewer_copies_when_memory_runs_out() -> None:
    nodes = _nodes(4, 4)
    model = ModelSpec.layered("m", layers=4, layer_gib=1.5)  # 6 GiB per copy, 8 GiB in all
    assert len(place(nodes, [model], copies=3)) == 1
    assert place(_nodes(1), [model], copies=1) == ()


def test_place_keeps_intact_copies_and_numbers_new_ones_after_next_id() -> None:
    nodes = _nodes(8, 8, 8)
    model = ModelSpec.layered("m", layers=2, layer_gib=2.0)
    kept = Pipeline(7, "m", ("n2", "n2"))
    pipes = place(nodes, [model], copies=2, keep=[kept], next_id=8)
    assert pipes[0] == kept
    assert pipes[1].pipeline_id == 8 and "n2" not in pipes[1].assignment


def test_memory_is_charged_once_per_node_and_slice() -> None:
    model = ModelSpec.layered("m", layers=2, layer_gib=2.0)
    profiles = {"a": NodeProfile("a", 4.0)}
    pipes = (Pipeline(0, "m", ("a", "a")), Pipeline(1, "m", ("a", "a")))
    assert SwarmPlan(profiles, {"m": model}, pipes).problems() == []


def test_plan_problems_name_what_is_wrong() -> None:
    model = ModelSpec.layered("m", layers=2, layer_gib=2.0, fallback="gone")
    profiles = {"a": NodeProfile("a", 3.0)}
    pipes = (
        Pipeline(0, "m", ("a", "a")),
        Pipeline(0, "m", ("a",)),
        Pipeline(2, "x", ("a",)),
        Pipeline(3, "m", ("a", "zz")),
    )
    problems = " | ".join(SwarmPlan(profiles, {"m": model}, pipes).problems())
    for text in (
        "used twice",
        "covers 1 slices",
        "unknown model 'x'",
        "unknown node 'zz'",
        "holds 4.000 GiB > its 3.000",
        "unknown fallback 'gone'",
    ):
        assert text in problems
    with pytest.raises(TopologyError, match="invalid plan"):
        SwarmPlan(profiles, {"m": model}, pipes).validate()


def test_holders_are_the_nodes_of_each_slice_across_copies() -> None:
    model = ModelSpec.layered("m", layers=3, layer_gib=1.0)
    pipes = (Pipeline(0, "m", ("a", "a", "b")), Pipeline(1, "m", ("c", "b", "b")))
    profiles = {n: NodeProfile(n) for n in "abc"}
    plan = SwarmPlan(profiles, {"m": model}, pipes)
    assert [plan.holders("m", i) for i in range(3)] == [{"a", "c"}, {"a", "b"}, {"b"}]
