"""Every role under its least-privilege ACL user: the whole flow works, with zero NOPERM."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from acl_helpers import RoleSettings, denials
from e2e_helpers import local_tokens, wait_for

from kvq import client
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.worker import Worker

pytestmark = pytest.mark.slow
LOADED = {"saturation_threshold": 1, "job_deadline_ms": 10_000, "dispatch_policy": "copies"}


def test_whole_flow_under_acl_users(
    settings: Settings, r: redis.Redis, tiny_model: Path, as_role: RoleSettings, run_in_thread
) -> None:
    keys = Keys(settings.prefix)
    mon = Monitor.from_settings(as_role("monitor").model_copy(update=LOADED))
    info = mon.register("tiny", tiny_model)
    run_in_thread(mon)
    ids = [f"w{i}" for i in range(len(info.slices))]
    one_each = {"worker_max_slices": 1}  # one worker per slice (one would fit every slice)
    workers = [
        Worker.from_settings(as_role("worker", w).model_copy(update=one_each), w) for w in ids
    ]
    for w in workers:
        run_in_thread(w)
    wait_for(lambda: all(w.holding for w in workers), 30, "every worker loaded via the monitor")
    cs = as_role("coordinator").model_copy(update=LOADED)
    coord = Coordinator.from_settings(cs, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    cr = redis.Redis.from_url(as_role("client").redis_url)
    try:
        rid = client.send(cr, keys, "tiny", prompt="least privilege", max_tokens=8)
        got = [e.token_id for e in client.events(cr, keys, rid, 60) if e.token_id is not None]
    finally:
        cr.close()
    assert got == local_tokens(tiny_model, "least privilege", 8)
    assert coord.dispatch.stats.remote_jobs > 0, "workers took part"
    assert all(w.served > 0 for w in workers)
    assert mon.desk is not None and mon.desk.answered >= len(workers)
    assert mon.quota is not None and mon.quota.disabled == [], "honest workers within quota"
    # a job it cannot decode: dead-lettered in its own stream, moved to the shared one by the
    # monitor with its id (its user may not write P:deadletter)
    r.xadd(keys.worker_inbox("w0"), {"t": "job", "m": "garbage"})
    wait_for(lambda: r.xlen(keys.deadletter()) == 1, 20, "the dead letter moved")
    ((_, dead),) = r.xrange(keys.deadletter())
    assert dead[b"worker"] == b"w0" and dead[b"source"] == keys.worker_inbox("w0").encode()
    assert b"invalid" in dead[b"reason"] and r.xlen(keys.worker_dead("w0")) == 0
    assert denials(r, settings.prefix) == []
