"""Swarm routing (H1-H11): which copy of a model serves a request, and what happens when a node
dies. Pure and synchronous over plain data; the caller owns time, threads and I/O.

- `types`: node profiles, models and slices, pipelines (copies), routes, options, cost weights;
- `plan`: the plan and its greedy placement (H1), with validation;
- `telemetry`: EWMAs and the per-node cost of H3, with the H4 penalty;
- `state`: plan + telemetry with cached copy costs, the fast path of `route_request`;
- `route`: `route_request` (H2), `failover_in_swarm` (H6, H7);
- `swarm`: the `Swarm` lifecycle (H8);
- `live`: `LiveRouter`, the coordinator's per-model dispatch policy (K1-K4);
- `topology`, `traffic`, `sim`: the `kvq swarm-sim` input format and simulator (H9).
- `throughput`, `calibrate`: tok/s of a backbone-only coordinator and W workers on paper,
  calibrated from `kvq bench pool` (`kvq swarm-sim --throughput`).
"""

from kvq.bus.records import WorkerView
from kvq.swarm.live import LivePolicy, LiveRoute, LiveRouter
from kvq.swarm.plan import SwarmPlan, place
from kvq.swarm.route import failover_in_swarm, route_problems, route_request
from kvq.swarm.sim import SimOptions, simulate
from kvq.swarm.state import SwarmState, pipeline_cost
from kvq.swarm.swarm import Replan, Rescue, Swarm, SwarmConfig
from kvq.swarm.telemetry import NodeTelemetry, node_cost
from kvq.swarm.topology import Topology, parse_nodes, parse_topology
from kvq.swarm.types import (
    CostWeights,
    FailoverOptions,
    FailoverResult,
    ModelSpec,
    NodeProfile,
    Pipeline,
    Replacement,
    Route,
    RoutingRequest,
    Slice,
    Status,
)

__all__ = [
    "CostWeights",
    "FailoverOptions",
    "FailoverResult",
    "LivePolicy",
    "LiveRoute",
    "LiveRouter",
    "ModelSpec",
    "NodeProfile",
    "NodeTelemetry",
    "Pipeline",
    "Replacement",
    "Replan",
    "Rescue",
    "Route",
    "RoutingRequest",
    "SimOptions",
    "Slice",
    "Status",
    "Swarm",
    "SwarmConfig",
    "SwarmPlan",
    "SwarmState",
    "Topology",
    "WorkerView",
    "failover_in_swarm",
    "node_cost",
    "parse_nodes",
    "parse_topology",
    "pipeline_cost",
    "place",
    "route_problems",
    "route_request",
    "simulate",
]
