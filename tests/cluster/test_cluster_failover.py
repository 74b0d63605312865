"""Issue 14 item 4: a master of a local cluster (3 masters, 1 replica each) is SIGKILLed under
load, its replica takes over, and the roles and clients carry on. Requests in flight at the kill
may be lost (Redis Cluster replicates asynchronously: writes the dead master acknowledged but
had not sent to its replica are gone); every request sent after the failover completes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from e2e_helpers import local_tokens, wait_for

from kvq import client
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.local.cluster import EmbeddedCluster
from kvq.monitor import Monitor
from kvq.worker import Worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster_with_replicas() -> Iterator[EmbeddedCluster]:
    """Set up before `run_in_thread`, so torn down after the roles have stopped."""
    with EmbeddedCluster(masters=3, replicas=1) as cluster:
        yield cluster


def test_a_master_killed_under_load_is_replaced_and_serving_goes_on(
    settings: Settings, tiny_model: Path, cluster_with_replicas: EmbeddedCluster, run_in_thread
) -> None:
    cluster = cluster_with_replicas
    s = settings.model_copy(
        update={
            "redis_url": cluster.url,
            "saturation_threshold": 1,
            "dispatch_policy": "copies",
            "job_deadline_ms": 1000,
            "reconnect_max_s": 0.5,
            "heartbeat_ttl_s": 3.0,
            "worker_max_slices": 1,  # one worker per slice (one would fit every slice)
        }
    )
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)
    run_in_thread(mon)
    workers = [Worker.from_settings(s, f"w{i}") for i in range(len(info.slices))]
    for w in workers:
        run_in_thread(w)
    wait_for(lambda: all(w.holding for w in workers), 60, "coverage")
    run_in_thread(Coordinator.from_settings(s, "c1", "tiny", tiny_model))
    want = local_tokens(tiny_model, "failover", 6)
    outcomes: list[tuple[float, str]] = []
    stop = threading.Event()

    def load() -> None:  # (when the request was sent, how it ended)
        while not stop.is_set():
            sent = time.monotonic()
            try:
                got = client.generate(
                    mon.board.r, keys, "tiny", prompt="failover", max_tokens=6, timeout_s=15
                )
                outcomes.append((sent, "ok" if got == want else f"wrong {got}"))
            except (TimeoutError, client.RequestFailed, redis.RedisError) as exc:
                outcomes.append((sent, f"{type(exc).__name__}: {exc}"))
                time.sleep(0.2)  # as a client would before it retries

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    wait_for(lambda: sum(o == "ok" for _, o in outcomes) >= 5, 60, "load before the kill")
    # the master of the model's request stream and control keys
    node = mon.board.r.get_node_from_key(keys.model_requests("tiny"))  # type: ignore[attr-defined]
    slot = mon.board.r.keyslot(keys.model_requests("tiny"))
    victim = next(n for n in cluster.masters if n.port == node.port)
    assert victim.proc is not None and cluster.master_port(slot) == victim.port
    victim.proc.kill()
    killed_at = time.monotonic()
    # the survivors say cluster_state:ok until they mark the victim failed: wait for its slots
    # to have a new master, not for "ok" alone (which held 0.1 s after the kill in one CI run)
    wait_for(
        lambda: cluster.master_port(slot) not in (None, victim.port) and cluster.healthy(),
        60,
        "a replica to take over the dead master's slots",
    )

    def client_sees_new_master() -> bool:  # the client's slot map, not only the cluster's
        try:
            mon.board.r.exists(keys.model_requests("tiny"))
            return True
        except redis.RedisError:
            return False

    wait_for(client_sees_new_master, 30, "the client to reach the slot's new master")
    recovered_at = time.monotonic()
    wait_for(
        lambda: sum(o == "ok" for t, o in outcomes if t > recovered_at) >= 10,
        120,
        "ten requests served after the failover",
    )
    stop.set()
    loader.join(30)
    after = [o for t, o in outcomes if t > recovered_at]
    around = [o for t, o in outcomes if killed_at - 15 < t <= recovered_at]
    failed = sorted({o for o in around if o != "ok"})
    print(
        f"failover took {recovered_at - killed_at:.1f}s; requests sent around it: "
        f"{len(around)}, not ok: {len(failed)} kinds {failed[:4]}"
    )
    assert all(o == "ok" for o in after), after[:3]
    assert not any(o.startswith("wrong") for _, o in outcomes)
