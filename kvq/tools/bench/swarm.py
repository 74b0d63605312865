"""`kvq bench swarm`: route decisions per second, and a large seeded simulation.

- `routes_per_s`: `Swarm.route` calls per second on a `nodes`-node, `models`-model swarm (the
  plan fills most of the nodes), each call preceded by one telemetry sample on a random node, so
  every route is decided on fresh telemetry (the sample is inside the timed loop: conservative);
  `routes_per_s_steady` is the same without samples.
- `sim_seconds`: wall time of a seeded swarm-sim run, plan included: `nodes` workers, `steps`
  requests of seeded traffic with a node killed (and the previous one revived) every 500 steps.
  `sim_digest` is identical across runs with the same seed.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from kvq.swarm import ModelSpec, NodeProfile, Swarm, SwarmConfig
from kvq.swarm.traffic import Traffic


def bench_swarm_topology(
    nodes: int, models: int, seed: int
) -> tuple[list[NodeProfile], list[ModelSpec], int]:
    """Seeded nodes (8-64 GiB, 2-60 ms, score 0.5-2) and models of 32 layers (0.5-1.5 GiB per
    layer), with copies per model sized to fill about 80% of the memory."""
    rng = random.Random(seed)
    profiles = [
        NodeProfile(
            f"n{i:04d}",
            float(rng.choice((8, 16, 24, 32, 48, 64))),
            round(rng.uniform(2, 60), 2),
            round(rng.uniform(0.5, 2.0), 2),
        )
        for i in range(nodes)
    ]
    specs = [
        ModelSpec.layered(f"model-{m}", 32, 0.5 + m / max(1, models - 1), experts=8)
        for m in range(models)
    ]
    total = sum(p.memory_gib for p in profiles)
    per_round = sum(s.gib for spec in specs for s in spec.slices)
    return profiles, specs, max(1, int(0.8 * total / per_round))


def _routes_per_s(swarm: Swarm, n: int, seed: int, fresh: bool) -> float:
    rng = random.Random(seed)
    models = list(swarm.plan.models)
    nodes = [n for n in swarm.plan.profiles]
    samples = [(rng.choice(nodes), rng.uniform(1, 80), rng.random()) for _ in range(n)]
    state = swarm.state
    t0 = time.perf_counter()
    for i in range(n):
        if fresh:
            node, lat, load = samples[i]
            state.observe(node, lat, load)
        swarm.route(models[i & 3 if len(models) == 4 else i % len(models)])
    return n / (time.perf_counter() - t0)


def run_sim(
    nodes: int, steps: int, seed: int, models: int = 4
) -> tuple[float, str, dict[str, int]]:
    """Seconds for the whole run, a digest of its outcome, and its counters."""
    t0 = time.perf_counter()
    profiles, specs, copies = bench_swarm_topology(nodes, models, seed)
    swarm = Swarm(profiles, specs, SwarmConfig(pipelines=copies))
    traffic = Traffic(swarm, seed, churn_every=500)
    traffic.run(steps)
    secs = time.perf_counter() - t0
    final = [swarm.route(m).pipeline_id for m in swarm.plan.models]
    counts = {
        "routed": traffic.routed,
        "unroutable": traffic.unroutable,
        "failovers": traffic.failovers,
        "unrecoverable": traffic.unrecoverable,
    }
    digest = hashlib.sha256(repr((counts, final, swarm.status())).encode()).hexdigest()[:16]
    return secs, digest, counts


def run_swarm_bench(
    nodes: int = 1000, models: int = 4, routes: int = 200_000, steps: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    profiles, specs, copies = bench_swarm_topology(nodes, models, seed)
    t0 = time.perf_counter()
    swarm = Swarm(profiles, specs, SwarmConfig(pipelines=copies))
    plan_s = time.perf_counter() - t0
    used = len({n for p in swarm.plan.pipelines for n in p.nodes})
    fresh = _routes_per_s(swarm, routes, seed, fresh=True)
    steady = _routes_per_s(swarm, routes, seed, fresh=False)
    sim_s, digest, counts = run_sim(nodes, steps, seed, models)
    return {
        "nodes": nodes,
        "models": models,
        "copies": len(swarm.plan.pipelines),
        "nodes_in_plan": used,
        "plan_seconds": round(plan_s, 3),
        "routes_per_s": round(fresh),
        "routes_per_s_steady": round(steady),
        "sim_workers": nodes,
        "sim_steps": steps,
        "sim_seconds": round(sim_s, 3),
        "sim_digest": digest,
        "sim": counts,
        "targets": {"routes_per_s": 50_000, "sim_seconds": 5.0},
    }
