"""Issue 11 item 5: no single job or message makes a real `kvq worker` process exit.

Forged jobs land in two workers' inboxes: one whose results stream (the worker's own for the
job's `coord`) is a key of another type (WRONGTYPE), jobs for a layer or a model it does not
hold. Each becomes a dead letter with its reason (and, where the results stream can be written,
a `BadJob` error result); each worker then answers a good job, whose forged `reply_to` it
ignores. The second worker's ACL user may not even write the dead-letter stream (before this
fix its first forged job made it exit 1): it logs the reason and goes on.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import redis

from kvq import wire
from kvq.config import Settings, child_env
from kvq.gguf import read_meta
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis
from kvq.monitor import Monitor
from kvq.slices import SliceSpec

pytestmark = pytest.mark.slow


def _job(
    hidden: int,
    job_id: str,
    reply_to: str,
    spec: SliceSpec,
    layer: int | None = None,
    model: str = "tiny",
    coord: str = "forger",
) -> dict[str, bytes | str]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    lo, hi = spec.expert_start, spec.expert_end
    ids = np.array([[lo, lo + 1]] * 2, dtype=np.int32)
    w = np.full(ids.shape, 0.5, dtype=np.float32)
    return wire.encode(
        wire.Job(
            job_id=job_id,
            model=model,
            layer=spec.layer_start if layer is None else layer,
            slice=spec.sid,
            expert_start=lo,
            expert_end=hi,
            coord=coord,
            reply_to=reply_to,
            deadline_ms=0,
            x=wire.Tensor.of(x),
            ids=wire.Tensor.of(ids),
            weights=wire.Tensor.of(w),
        )
    )


def _acl_url(r: redis.Redis, server: EmbeddedRedis, user: str, *patterns: str) -> str:
    """A Redis user that may touch only keys matching `patterns`."""
    r.execute_command(
        "ACL", "SETUSER", user, "reset", "on", ">secret-pw", *(f"~{p}" for p in patterns), "+@all"
    )
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
    specs = [
        next(s for s in info.slices.values() if s.layer_start == layer and s.expert_start == 0)
        for layer in (0, 1)
    ]
    r.delete(keys.model_target("tiny"))
    r.hset(keys.model_target("tiny"), mapping={s.sid: 1 for s in specs})
    full = _acl_url(r, redis_server, f"w-{p}-full", f"{p}:*")
    # tagged keys and the model set only: no P:deadletter
    narrow = _acl_url(r, redis_server, f"w-{p}-narrow", f"{p}:models", f"{p}:{{*")
    kids = Children(child_env(settings), log_dir=str(tmp_path))
    try:
        for name, url in (("full", full), ("narrow", narrow)):
            env = child_env(
                settings.model_copy(update={"redis_url": url}),
                worker_market="direct",
                worker_max_slices=1,
            )
            kids.spawn(name, "worker", "--id", name, env=env)
            kids.wait_for(
                lambda n=name: any(
                    v.worker_id == n and v.ready and v.alive  # type: ignore[misc]
                    for v in mon.board.workers("tiny")
                ),
                60,
                name,
            )
        held = {v.worker_id: info.slices[v.slice_id] for v in mon.board.workers("tiny")}
        hidden = read_meta(tiny_model).embedding_length
        for name, spec in held.items():
            r.set(keys.worker_results(name, "wrongtype"), "a string, not a stream")
            inbox = keys.worker_inbox(name)
            r.xadd(inbox, _job(hidden, f"{name}-wt", "x", spec, coord="wrongtype"))
            r.xadd(inbox, _job(hidden, f"{name}-layer", "x", spec, layer=1 - spec.layer_start))
            r.xadd(inbox, _job(hidden, f"{name}-model", "x", spec, model="other"))
            r.xadd(inbox, _job(hidden, f"{name}-good", "elsewhere:out", spec))
        for name in held:
            out = keys.worker_results(name, "forger")
            kids.wait_for(
                lambda o=out, n=name: _result(r, o, f"{n}-good"),
                30,  # type: ignore[misc]
                f"{name}'s good result",
            )
            good = _result(r, out, f"{name}-good")
            assert good is not None and good.error is None and good.y is not None
            for job_id in ("layer", "model"):  # its results stream was writable: it says why
                res = _result(r, out, f"{name}-{job_id}")
                assert res is not None and res.error is not None and res.error.type == "BadJob"
            assert r.xpending(keys.worker_inbox(name), "workers")["pending"] == 0, "all acked"
        assert kids.dead() == [], "both workers still run"
        assert not r.exists("elsewhere:out"), "a forged reply_to aims no result anywhere"
        reasons = [
            f[b"reason"].decode()
            for _, f in r.xrange(keys.deadletter())
            if f[b"source"] == keys.worker_inbox("full").encode()
        ]
        assert len(reasons) == 3, reasons
        assert sum("WRONGTYPE" in x and "wrongtype" in x for x in reasons) == 1, reasons
        assert sum("this server holds tiny layers" in x for x in reasons) == 2, reasons
        assert r.xlen(keys.deadletter()) == 3, "the narrow worker could not dead-letter"
        log = (tmp_path / "narrow.log").read_text()
        assert log.count("cannot dead-letter") == 3, log[-2000:]
        assert r.type(keys.worker_heartbeat("full")) == b"string", "its own key is untouched"
    finally:
        kids.stop_all()
