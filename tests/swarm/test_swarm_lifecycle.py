"""The Swarm lifecycle (H8) and several models in one swarm (H10)."""

from __future__ import annotations

import pytest

from kvq.errors import (
    CapacityError,
    NoRoute,
    RoutingError,
    TopologyError,
    UnknownModel,
    UnknownNode,
)
from kvq.swarm import ModelSpec, NodeProfile, Swarm, SwarmConfig


def _swarm(copies: int = 2) -> Swarm:
    nodes = [
        NodeProfile("gpu", 48, latency_ms=4, score=2.0),
        NodeProfile("desktop", 16, latency_ms=9),
        NodeProfile("mini", 12, latency_ms=12),
        NodeProfile("laptop", 12, latency_ms=14),
    ]
    models = [
        ModelSpec.layered("base", 12, 2.0, experts=8, experts_per_slice=4),
        ModelSpec.layered("code", 6, 1.0),
    ]
    return Swarm(nodes, models, SwarmConfig(pipelines=copies))


def test_new_plans_every_copy_and_starts_healthy() -> None:
    s = _swarm()
    assert s.plan.problems() == []
    assert [len(s.plan.of_model(m)) for m in ("base", "code")] == [2, 2]
    assert s.status() == "healthy"
    r = s.route("base")
    assert r.model_id == "base" and r.pipeline.stages == ("gpu",)
    assert s.route("code").model_id == "code"


def test_mark_down_rescues_then_marks_and_mark_alive_heals() -> None:
    s = _swarm()
    lost = s.route("base")
    rescues = {r.model_id: r for r in s.mark_down("gpu")}
    assert set(rescues) == {"base", "code"}
    base = rescues["base"]
    assert base.lost == lost and base.result is not None
    assert base.result.rung == "copy" and not base.result.degraded
    assert "gpu" not in base.result.route.pipeline.nodes
    assert not s.state.alive("gpu") and s.status() == "degraded"
    assert s.route("base").pipeline_id == base.result.route.pipeline_id
    assert s.mark_down("gpu") == ()  # already down: nothing more was lost
    s.mark_alive("gpu")
    assert s.status() == "healthy" and s.route("base").pipeline_id == lost.pipeline_id


def test_failed_means_zero_live_nodes_not_zero_copies() -> None:
    s = _swarm()
    for n in ("gpu", "desktop", "mini"):
        s.mark_down(n)
    assert s.status() == "degraded"  # laptop survives: still serving what it can
    s.mark_down("laptop")
    assert s.status() == "failed"
    with pytest.raises(NoRoute):
        s.route("base")


def test_unrecoverable_rescue_is_reported_not_raised() -> None:
    s = _swarm(copies=1)
    assert s.route("base").pipeline.stages == ("gpu",)
    (rescue,) = [r for r in s.mark_down("gpu") if r.model_id == "base"]
    assert rescue.result is None and rescue.error is not None
    assert "no fallback model" in str(rescue.error)
    assert not s.state.alive("gpu") and s.status() == "degraded"


def test_add_node_grows_without_restart_and_keeps_intact_copies() -> None:
    s = _swarm()
    s.mark_down("gpu")
    old = {p.pipeline_id: p for p in s.plan.pipelines}
    rp = s.add_node(NodeProfile("edge", 64, latency_ms=3, score=2.0))
    assert s.plan.problems() == [] and not rp.missing
    assert set(rp.dropped) == {pid for pid, p in old.items() if "gpu" in p.nodes}
    assert set(rp.added) == {p.pipeline_id for p in s.plan.pipelines} - set(old)
    assert min(rp.added) > max(old)  # ids are never reused
    for pid, p in old.items():
        assert (p in s.plan.pipelines) == ("gpu" not in p.nodes), pid
    assert all("gpu" not in p.nodes for p in s.plan.pipelines)  # a down node gets no new work
    assert s.status() == "healthy"
    assert "edge" in s.route("base").pipeline.nodes
    with pytest.raises(TopologyError, match="already"):
        s.add_node(NodeProfile("edge", 1))


def test_remove_node_retires_and_relocates() -> None:
    s = _swarm()
    rp = s.remove_node("desktop")
    assert "desktop" not in s.plan.profiles and "desktop" not in s.state.telemetry
    assert all("desktop" not in p.nodes for p in s.plan.pipelines)
    assert s.plan.problems() == []
    assert rp.dropped and (rp.added or rp.missing)
    assert s.status() == ("degraded" if rp.missing else "healthy")
    with pytest.raises(UnknownNode):
        s.remove_node("desktop")


def test_ids_and_capacity_are_checked_at_new() -> None:
    with pytest.raises(CapacityError, match="'big'"):
        Swarm([NodeProfile("a", 1.0)], [ModelSpec.layered("big", 4, 1.0)])
    with pytest.raises(TopologyError, match="unique"):
        Swarm([NodeProfile("a"), NodeProfile("a")], [ModelSpec.layered("m", 1, 1.0)])
    with pytest.raises(TopologyError, match="fallback"):
        Swarm([NodeProfile("a")], [ModelSpec.layered("m", 1, 1.0, fallback="x")])


def test_stop_and_unknown_names() -> None:
    s = _swarm()
    with pytest.raises(UnknownModel):
        s.route("nope")
    with pytest.raises(UnknownNode):
        s.mark_down("nope")
    s.stop()
    assert s.status() == "stopped"
    with pytest.raises(RoutingError, match="stopped"):
        s.route("base")
