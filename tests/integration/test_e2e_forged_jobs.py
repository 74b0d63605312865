"""Issue 11 item 5: no single job or message makes a real `kvq worker` process exit.

Forged jobs land in two workers' inboxes: a `reply_to` naming a key of another type
(WRONGTYPE), one outside the worker's ACL user (NOPERM), jobs for a layer or a model it does not
hold. Each becomes a dead letter with its reason (and, where the reply stream can be written, an
`BadJob` error result); each worker then answers a good job. The second worker's ACL user may
not even write the dead-letter stream (before this fix its first forged job made it exit 1):
it logs the reason and goes on.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import redis

from kvq import wire
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.model import read_meta
from kvq.monitor import Monitor
from kvq.procs import Children
from kvq.server import EmbeddedRedis
from kvq.slices import SliceSpec

pytestmark = pytest.mark.slow


def _job(hidden: int, job_id: str, reply_to: str, spec: SliceSpec, layer: int | None = None,
         model: str = "tiny") -> dict[str, bytes | str]:  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    lo, hi = spec.expert_start, spec.expert_end
    ids = np.array([[lo, lo + 1]] * 2, dtype=np.int32)
    w = np.full(ids.shape, 0.5, dtype=np.float32)
    return wire.encode(wire.Job(
        job_id=job_id, model=model, layer=spec.layer_start if layer is None else layer,
        slice=spec.sid, expert_start=lo, expert_end=hi, coord="forger", reply_to=reply_to,
        deadline_ms=0, x=wire.Tensor.of(x), ids=wire.Tensor.of(ids), weights=wire.Tensor.of(w),
    ))  # fmt: skip


def _acl_url(r: redis.Redis, server: EmbeddedRedis, user: str, *patterns: str) -> str:
    """A Redis user that may touch only keys matching `patterns`."""
    r.execute_command("ACL", "SETUSER", user, "reset", "on", ">secret-pw",
                      *(f"~{p}" for p in patterns), "+@all")  # fmt: skip
    u = urlparse(server.url)
    return f"redis://{user}:secret-pw@{u.hostname}:{u.port}{u.path or '/0'}"


def _result(r: redis.Redis, stream: str, job_id: str) -> wire.Result | None:
    for _, f in r.xrange(stream):
        res = wire.decode(f, wire.Result)
        if res.job_id == job_id:
            return res
    return None


def test_forged_jobs_never_stop_a_worker_process(
    settings: Settings, tiny_model: Path, tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    keys, p = Keys(settings.prefix), settings.prefix
    mon = Monitor.from_settings(settings)
    r = mon.board.r
    info = mon.register("tiny", tiny_model)
    specs = [next(s for s in info.slices.values() if s.layer_start == layer
                  and s.expert_start == 0) for layer in (0, 1)]  # fmt: skip
    r.delete(keys.model_target("tiny"))
    r.hset(keys.model_target("tiny"), mapping={s.sid: 1 for s in specs})
    full = _acl_url(r, redis_server, f"w-{p}-full", f"{p}:*")
    # tagged keys and the model set only: no P:deadletter
    narrow = _acl_url(r, redis_server, f"w-{p}-narrow", f"{p}:models", f"{p}:{{*")
    kids = Children(child_env(settings), log_dir=str(tmp_path))
    out = keys.coord_results("forger")
    try:
        for name, url in (("full", full), ("narrow", narrow)):
            kids.spawn(name, "worker", "--id", name,
                       env=child_env(settings.model_copy(update={"redis_url": url})))  # fmt: skip
            kids.wait_for(lambda n=name: any(v.worker_id == n and v.ready and v.alive  # type: ignore[misc]
                                             for v in mon.board.workers("tiny")), 60, name)  # fmt: skip
        held = {v.worker_id: info.slices[v.slice_id] for v in mon.board.workers("tiny")}
        hidden = read_meta(tiny_model).embedding_length
        for name, spec in held.items():
            other_layer = 1 - spec.layer_start
            for job_id, reply_to, kw in [
                ("hb", keys.worker_heartbeat(name), {}),  # a string key: WRONGTYPE
                ("meta", keys.model_meta("tiny"), {}),  # a hash: WRONGTYPE
                ("acl", "elsewhere:out", {}),  # outside its ACL user: NOPERM
                ("layer", out, {"layer": other_layer}),  # a slice it does not hold
                ("model", out, {"model": "other"}),
            ]:
                r.xadd(
                    keys.worker_inbox(name), _job(hidden, f"{name}-{job_id}", reply_to, spec, **kw)
                )
            r.xadd(keys.worker_inbox(name), _job(hidden, f"{name}-good", out, spec))
        for name in held:
            kids.wait_for(lambda n=name: _result(r, out, f"{n}-good"), 30, f"{name}'s good result")  # type: ignore[misc]
            good = _result(r, out, f"{name}-good")
            assert good is not None and good.error is None and good.y is not None
            for job_id in ("layer", "model"):  # the reply stream was writable: it says why
                res = _result(r, out, f"{name}-{job_id}")
                assert res is not None and res.error is not None and res.error.type == "BadJob"
            assert r.xpending(keys.worker_inbox(name), "workers")["pending"] == 0, "all acked"
        assert kids.dead() == [], "both workers still run"
        reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.deadletter())
                   if f[b"source"] == keys.worker_inbox("full").encode()]  # fmt: skip
        assert len(reasons) == 5, reasons
        assert sum("WRONGTYPE" in x for x in reasons) == 2, reasons
        assert any("NoPermissionError" in x and "elsewhere:out" in x for x in reasons), reasons
        assert sum("this server holds tiny layers" in x for x in reasons) == 2, reasons
        assert r.xlen(keys.deadletter()) == 5, "the narrow worker could not dead-letter"
        log = (tmp_path / "narrow.log").read_text()
        assert log.count("cannot dead-letter") == 5, log[-2000:]
        assert r.type(keys.worker_heartbeat("full")) == b"string", "its own key is untouched"
    finally:
        kids.stop_all()
