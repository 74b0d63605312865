"""Seeded, deterministic traffic for the simulator and the benchmark (no clocks, no I/O).

Each step is one request: it is routed (models in turn), holds every node of its route for
`hold` steps, and those nodes report samples: load = requests held / `slots`, latency = the
node's declared latency (or 20 ms) x (1 + 0.25 x requests held) x a lognormal jitter. Loads
fall again when requests are released. `churn_every` > 0 kills a random live node every that many
steps (a node of the current route of a random model, through `mark_down`, so failover runs)
and revives the node killed before it.
"""

from __future__ import annotations

import random
from collections import deque

from kvq.errors import RoutingError
from kvq.swarm.swarm import Swarm

DEFAULT_LATENCY_MS = 20.0


class Traffic:
    """Drives a swarm with seeded requests; counters say what happened."""

    __slots__ = (
        "_held",
        "_killed",
        "_models",
        "_ring",
        "churn_every",
        "failovers",
        "hold",
        "rng",
        "routed",
        "slots",
        "steps",
        "swarm",
        "unroutable",
        "unrecoverable",
    )

    def __init__(
        self, swarm: Swarm, seed: int = 0, hold: int = 8, slots: int = 4, churn_every: int = 0
    ) -> None:
        self.swarm, self.rng = swarm, random.Random(seed)
        self.hold, self.slots, self.churn_every = hold, slots, churn_every
        self._held: dict[str, int] = {}
        self._ring: deque[frozenset[str]] = deque(frozenset() for _ in range(hold))
        self._killed: str | None = None
        self._models = list(swarm.plan.models)
        self.steps = self.routed = self.unroutable = self.failovers = self.unrecoverable = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        self.steps += 1
        if self.churn_every and self.steps % self.churn_every == 0:
            self._churn()
        st = self.swarm.state
        for n in self._ring.popleft():
            held = self._held[n] = self._held.get(n, 1) - 1
            if n in st.telemetry:
                st.observe(n, load=held / self.slots)
        models = self._models
        try:
            route = self.swarm.route(models[self.steps % len(models)])
        except RoutingError:
            self.unroutable += 1
            self._ring.append(frozenset())
            return
        self.routed += 1
        nodes = route.pipeline.nodes
        gauss = self.rng.gauss
        for n in sorted(nodes):
            held = self._held[n] = self._held.get(n, 0) + 1
            t = st.telemetry[n]
            base = DEFAULT_LATENCY_MS if t.declared_latency_ms is None else t.declared_latency_ms
            lat = base * (1.0 + 0.25 * held) * (1.0 + 0.1 * gauss(0.0, 1.0)) ** 2
            st.observe(n, latency_ms=lat, load=held / self.slots)
        self._ring.append(nodes)

    def _churn(self) -> None:
        if self._killed is not None and self._killed in self.swarm.state.telemetry:
            self.swarm.mark_alive(self._killed)
        try:  # a node of a route in use, so that failover has something to rescue
            route = self.swarm.route(self._models[self.rng.randrange(len(self._models))])
        except RoutingError:
            self._killed = None
            return
        self._killed = sorted(route.pipeline.nodes)[self.rng.randrange(len(route.pipeline.nodes))]
        for rescue in self.swarm.mark_down(self._killed):
            self.failovers += 1
            self.unrecoverable += rescue.result is None
