"""A local Redis Cluster from the bundled server binary, for development and tests.

`EmbeddedCluster(masters=3, replicas=1)` starts `masters × (1 + replicas)` servers in cluster
mode on free ports of 127.0.0.1, spreads the 16384 hash slots evenly over the masters, joins
every node (`CLUSTER MEET`), makes each replica follow its master (`CLUSTER REPLICATE`) and
waits until every node reports `cluster_state:ok`. `kvq server --cluster N` runs one.

Clients reach it with `url` (`redis+cluster://127.0.0.1:<port>`: any node; the client learns
the slot map from it).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis

from kvq.errors import ServerError
from kvq.local.server import EmbeddedRedis, free_port

SLOTS = 16384
NODE_TIMEOUT_MS = 2000  # a master silent this long is failed over to its replica


class EmbeddedCluster:
    """`masters` masters with `replicas` replicas each; use as a context manager."""

    def __init__(self, masters: int = 3, replicas: int = 0, data_dir: str | Path | None = None):
        if masters < 1 or replicas < 0:
            raise ServerError(
                f"a cluster needs >= 1 master and >= 0 replicas, got {masters}/{replicas}"
            )
        self.masters_n, self.replicas_n = masters, replicas
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvq-cluster-")).resolve()
        self.nodes: list[EmbeddedRedis] = []
        self.bus_ports: list[int] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def masters(self) -> list[EmbeddedRedis]:
        return self.nodes[: self.masters_n]

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        try:
            self._start_nodes()
            self._assign_slots()
            self._join()
            self._wait_ok(timeout_s)
            self._follow()
            self._wait_ok(timeout_s)
            self._wait_replicas(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _start_nodes(self) -> None:
        for i in range(self.masters_n * (1 + self.replicas_n)):
            node_dir = self.data_dir / f"node-{i}"
            bus = free_port()  # explicit: the default, port + 10000, may not exist
            args = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--cluster-port",
                str(bus),
            )
            self.nodes.append(EmbeddedRedis(data_dir=node_dir, extra_args=args).start())
            self.bus_ports.append(bus)

    def _client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_connect_timeout=1, decode_responses=True)

    def _assign_slots(self) -> None:
        per = SLOTS // self.masters_n
        for i, node in enumerate(self.masters):
            first, last = i * per, (SLOTS - 1 if i == self.masters_n - 1 else (i + 1) * per - 1)
            with contextlib.closing(self._client(node)) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)

    def _join(self) -> None:
        with contextlib.closing(self._client(self.nodes[0])) as c:
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)

    def _follow(self) -> None:
        for r in range(self.replicas_n):
            for m, master in enumerate(self.masters):
                replica = self.nodes[self.masters_n * (1 + r) + m]
                with contextlib.closing(self._client(master)) as c:
                    master_id = c.execute_command("CLUSTER", "MYID")
                with contextlib.closing(self._client(replica)) as c:
                    self._retry(partial(c.execute_command, "CLUSTER", "REPLICATE", master_id))

    @staticmethod
    def _retry(call: Callable[[], object], timeout_s: float = 10.0) -> None:
        """The replica may not know its master's id yet (gossip): try again until it does."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                call()
                return
            except redis.ResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _wait_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._state(n) == "ok" for n in self.nodes):
                return
            time.sleep(0.1)
        raise ServerError(
            f"cluster not ok after {timeout_s}s: {[self._state(n) for n in self.nodes]}"
        )

    def _wait_replicas(self, timeout_s: float) -> None:
        """Until every replica's link to its master is up (it has the data)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes[self.masters_n :]:
            with contextlib.closing(self._client(node)) as c:
                while c.info("replication").get("master_link_status") != "up":
                    if time.monotonic() > deadline:
                        raise ServerError(f"replica on port {node.port} not synced in {timeout_s}s")
                    time.sleep(0.1)

    def healthy(self) -> bool:
        """Every live node says `cluster_state:ok` (after a failover: the slots are served)."""
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        return bool(live) and all(self._state(n) == "ok" for n in live)

    def master_port(self, slot: int) -> int | None:
        """The port of the master serving `slot`, as the first live node that answers sees it
        (None if none answers). Right after a master dies the others still list it, and still
        say `cluster_state:ok`, until they mark it failed (`NODE_TIMEOUT_MS`): a failover is
        over when this names another port and `healthy()` holds."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with contextlib.closing(self._client(node)) as c:
                try:
                    ranges = c.execute_command("CLUSTER", "SLOTS")
                except redis.RedisError:
                    continue
            for first, last, master, *_replicas in ranges:
                if int(first) <= slot <= int(last):
                    return int(master[1])
            return None
        return None

    def _state(self, node: EmbeddedRedis) -> str:
        with contextlib.closing(self._client(node)) as c:
            try:
                info = c.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return "down"
        text = info if isinstance(info, str) else str(info)
        for line in text.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes, self.bus_ports = [], []
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def local_redis(cluster: int = 0) -> EmbeddedRedis | EmbeddedCluster:
    """A private server for a benchmark (a context manager that starts it): one node, or a
    local `cluster`-master Redis Cluster when `cluster` > 0 (its `url` is `redis+cluster://`)."""
    return EmbeddedCluster(masters=cluster) if cluster > 0 else EmbeddedRedis()
