"""The monitor on a real Redis: seeded demand (K8), boost under saturation (K7, K10), reaping."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from kvq.bus import Scripts
from kvq.config import Settings
from kvq.keys import WORKER_GROUP, Keys
from kvq.model import make_tiny
from kvq.monitor import Monitor


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mon") / "m.gguf"
    make_tiny(path, layers=3, experts=8)
    return path


def _slots(r: redis.Redis, keys: Keys, coord: str, busy: int, age_s: float = 0.0) -> None:
    ts = int((time.time() - age_s) * 1000)
    r.hset(keys.coord_slots(coord), mapping={"model": "m", "busy": busy, "total": 4, "ts_ms": ts})
    r.sadd(keys.model_coordinators("m"), coord)


def _targets(r: redis.Redis, keys: Keys) -> set[int]:
    return {int(v) for v in r.hvals(keys.model_target("m"))}


def test_register_seeds_demand_from_metadata(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    info = Monitor(settings).register("m", model)
    assert len(info.slices) == 3 * (8 // settings.slice_experts)
    assert r.hlen(keys.model_target("m")) == len(info.slices)
    assert _targets(r, keys) == {settings.base_replicas}
    meta = r.hgetall(keys.model_meta("m"))
    assert meta[b"expert_count"] == b"8" and meta[b"block_count"] == b"3"
    assert r.sismember(keys.models(), "m")


def test_saturation_raises_then_drain_lowers_targets(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    mon = Monitor(settings)
    mon.register("m", model)
    _slots(r, keys, "c1", busy=1)
    assert not mon.poll("m").saturated
    assert _targets(r, keys) == {settings.base_replicas}
    _slots(r, keys, "c1", busy=settings.saturation_threshold)
    st = mon.poll("m")
    assert st.saturated and st.effective == settings.base_replicas + settings.boost_replicas
    assert _targets(r, keys) == {st.effective}
    assert r.hget(keys.model_state("m"), "saturated") == b"1"
    _slots(r, keys, "c1", busy=0)
    assert mon.poll("m").effective == settings.base_replicas
    assert _targets(r, keys) == {settings.base_replicas}


def test_stale_and_vanished_coordinators_are_ignored(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    mon = Monitor(settings)
    mon.register("m", model)
    _slots(r, keys, "old", busy=4, age_s=settings.slot_state_stale_s + 5)
    r.sadd(keys.model_coordinators("m"), "gone")  # no slots key at all
    st = mon.poll("m")
    assert not st.saturated and st.coordinators == 0
    assert not r.sismember(keys.model_coordinators("m"), "gone")


def test_reap_releases_slice_and_requeues_unanswered_jobs(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    s = settings.model_copy(update={"base_replicas": 2})
    mon = Monitor(s)
    info = mon.register("m", model)
    sid = sorted(info.slices)[0]
    r.delete(keys.model_target("m"))
    r.hset(keys.model_target("m"), sid, 2)
    scripts = Scripts(r, keys)
    assert scripts.volunteer(r, "m", "dead") == sid
    assert scripts.volunteer(r, "m", "live") == sid
    r.set(keys.worker_heartbeat("live"), sid, ex=30)  # "dead" has no heartbeat
    inbox = keys.worker_inbox("dead")
    r.xgroup_create(inbox, WORKER_GROUP, id="0", mkstream=True)
    ids = [r.xadd(inbox, {"t": "job", "m": f"job{i}"}) for i in range(3)]
    r.xreadgroup(WORKER_GROUP, "dead", {inbox: ">"}, count=2)  # 2 delivered ...
    r.xack(inbox, WORKER_GROUP, ids[0])  # ... one of them answered
    assert mon.reap("m") == ["dead"]
    moved = [f[b"m"] for _, f in r.xrange(keys.worker_inbox("live"))]
    assert moved == [b"job1", b"job2"], "pending and undelivered jobs move, answered ones don't"
    assert not r.exists(inbox)
    assert r.hget(keys.model_coverage("m"), sid) == b"1"
    assert r.hgetall(keys.model_workers("m")) == {b"live": sid.encode()}
    assert mon.reap("m") == []
