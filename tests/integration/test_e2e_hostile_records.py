"""No value a worker writes into its own `info` hash can crash or stall another role (issue 32
item 1). A hostile worker `evil` holds the model's slices beside an honest one (its assignment
and beat written as the market and a worker write them) and, one case at a time, writes every
field of its `WorkerInfo` with an oversized, over-deep, wrong-typed or wrong-shaped value. After
each, the monitor, the coordinator and the honest worker still run, and a request still gets
all-local's tokens within a few seconds. What a bad record costs its writer: it does not decode
and is ignored (the worker is as good as absent), logged once per kind of error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e_helpers import local_tokens, wait_for, wait_ready

from kvq import client
from kvq.bus.records import WorkerInfo
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.worker import Worker

pytestmark = pytest.mark.slow
DEEP = "[" * 100_000 + "]" * 100_000
BIG = "9" * 1_000_000
BAD_VALUES = {
    "oversized": BIG,
    "over-deep": DEEP,
    "wrong-typed": "\xff\x00 not a number {",
    "wrong-shaped": '{"c1": {"x": [1, 2]}, "m": 1e400, "w": [[["s"]]]}',
    "out of range": "-1e400",
    "nan": "nan",
    "huge cpus": ",".join(["0-65535"] * 200),
}
CASES = [(field, kind) for field in WorkerInfo.fields() for kind in BAD_VALUES]


def test_every_field_of_a_worker_record_written_badly_leaves_every_role_serving(
    settings: Settings, run_in_thread, tiny_model: Path
) -> None:
    s = settings.model_copy(update={"job_deadline_ms": 500, "worker_max_slices": 0})
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    honest = Worker.from_settings(s, "w0")
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    threads = {"monitor": run_in_thread(mon), "worker": run_in_thread(honest)}
    wait_ready(mon, "tiny", 1)
    threads["coordinator"] = run_in_thread(coord)
    r, keys = mon.board.r, Keys(s.prefix)
    want = local_tokens(tiny_model, "hostile", 4)
    good = {k.decode(): v.decode() for k, v in r.hgetall(keys.worker_info("w0")).items()}
    held = r.hget(keys.model_workers("tiny"), "w0")
    assert good and held
    slowest = 0.0
    for field, kind in CASES:
        # evil holds what w0 holds, beats, and writes its record with one field bad
        r.hset(keys.model_workers("tiny"), "evil", held)
        r.set(keys.worker_heartbeat("evil"), "evil-instance", px=60_000)
        r.delete(keys.worker_info("evil"))
        r.hset(
            keys.worker_info("evil"),
            mapping=good | {"instance": "evil-instance", field: BAD_VALUES[kind]},
        )
        time.sleep(0.15)  # a few refreshes of the coordinator and polls of the monitor
        t0 = time.monotonic()
        got = client.generate(r, keys, "tiny", prompt="hostile", max_tokens=4, timeout_s=30)
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        assert got == want, (field, kind)
        dead = [name for name, t in threads.items() if not t.is_alive()]
        assert not dead, f"{dead} died after {field} = {kind}"
        assert took < 10, f"a request took {took:.1f} s after {field} = {kind}"
        mon.board.workers("tiny")  # the monitor's own read of every record decodes too
    print(
        f"{len(CASES)} bad records ({len(WorkerInfo.fields())} fields x {len(BAD_VALUES)} "
        f"kinds): every role alive, every request served, slowest {slowest:.2f} s"
    )
    wait_for(lambda: honest.holding is not None, 5, "the honest worker still holding")
