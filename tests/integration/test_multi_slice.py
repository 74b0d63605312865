"""Issue 10 item 4: several slices per worker, on a real Redis server.

One `kvq worker` process takes a slice of each of two models, or two slices of one model,
serves jobs of both from its one inbox, and its results equal the same slices computed here;
killed, the monitor reaps both slices. A memory budget that fits one slice stops the volunteering at one, reserving nothing
else; through the monitor's market (a least-privilege worker's path) the asks carry the models
it holds and its room.
"""

from __future__ import annotations

import functools
import http.server
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from waiting import wait_for

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.catalog import ModelInfo
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.model.expert_slice import map_slice
from kvq.monitor import Monitor
from kvq.slices import SliceSpec
from kvq.tools.synth import make_tiny
from kvq.worker import Worker
from kvq.worker.budget import GIB

_OPTS = BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different one-layer models of 8 experts (one slice each with 8 experts a slice)."""
    d = tmp_path_factory.mktemp("multi")
    out = {"alpha": d / "alpha.gguf", "beta": d / "beta.gguf"}
    make_tiny(out["alpha"], layers=1, experts=8, seed=11)
    make_tiny(out["beta"], layers=1, experts=8, hidden=32, expert_ffn=48, seed=12)
    return out


def _register(s: Settings, models: dict[str, Path]) -> tuple[Monitor, dict[str, ModelInfo]]:
    mon = Monitor.from_settings(s)
    return mon, {m: mon.register(m, path) for m, path in models.items()}


def _job(info: ModelInfo, job_id: str, coord: str, seed: int, sid: str | None = None) -> wire.Job:
    spec = info.slices[sid] if sid is not None else next(iter(info.slices.values()))
    rng = np.random.default_rng(seed)
    hidden, lo, hi = info.meta.embedding_length, spec.expert_start, spec.expert_end
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ids = np.argsort(rng.random((3, hi - lo)), axis=1)[:, :2].astype(np.int32) + lo
    w = rng.random((3, 2)).astype(np.float32)
    return wire.Job(
        job_id=job_id,
        model=info.model,
        layer=spec.layer_start,
        slice=spec.sid,
        expert_start=lo,
        expert_end=hi,
        coord=coord,
        reply_to="ignored",
        deadline_ms=0,
        x=wire.Tensor.of(x),
        ids=wire.Tensor.of(ids),
        weights=wire.Tensor.of(w),
    )


def _local(path: Path, info: ModelInfo, job: wire.Job) -> np.ndarray:
    """The job computed here, through the coordinator's own path for a local slice."""
    spec: SliceSpec = info.slices[job.slice]
    layer = spec.layer_start
    sl = map_slice(path, spec.ranges_of(layer), layer, spec.expert_start, spec.expert_end)
    bank = Bank([sl], _OPTS, "cpu")
    server = ExpertServer("here", info.model, bank, job.x.shape[1], torch.float32)
    res = server.handle(job)
    assert res.error is None and res.y is not None, res.error
    return res.y.array()


def _results(r: redis.Redis, stream: str) -> dict[str, wire.Result]:
    return {res.job_id: res for res in (wire.decode(f, wire.Result) for _, f in r.xrange(stream))}


def _served_as_local(
    r: redis.Redis,
    keys: Keys,
    kids: Children,
    worker: str,
    jobs: list[wire.Job],
    local: Callable[[wire.Job], np.ndarray],
) -> None:
    """Sends `jobs` to `worker`'s one inbox; every result equals `local(job)`, bit for bit."""
    for job in jobs:
        r.xadd(keys.worker_inbox(worker), wire.encode(job))
    out = keys.worker_results(worker, "c0")
    kids.wait_for(lambda: len(_results(r, out)) == len(jobs), 60, "every result")
    got = _results(r, out)
    for job in jobs:
        res = got[job.job_id]
        assert res.error is None and res.y is not None, res.error
        want = local(job)
        assert res.y.array().shape == want.shape
        assert np.array_equal(res.y.array(), want), f"{job.job_id}: remote != local"


def _ready(mon: Monitor, model: str, worker: str) -> bool:
    return any(v.worker_id == worker and v.alive and v.ready for v in mon.board.workers(model))


@pytest.mark.slow
def test_one_worker_process_serves_two_slices_of_two_models_from_one_inbox(
    settings: Settings, two_models: dict[str, Path], tmp_path: Path
) -> None:
    s = settings.model_copy(update={"slice_experts": 8, "heartbeat_ttl_s": 1.5})
    mon, infos = _register(s, two_models)
    keys, r = Keys(s.prefix), mon.board.r
    env = child_env(s, worker_market="direct") | {"OMP_NUM_THREADS": "1"}
    kids = Children(env, log_dir=str(tmp_path))
    try:
        kids.spawn("multi", "worker", "--id", "multi")
        kids.wait_for(
            lambda: all(_ready(mon, m, "multi") for m in infos),
            90,
            "one worker serving a slice of each model",
        )
        for m, info in infos.items():
            assert mon.board.assignments(m) == {"multi": tuple(info.slices)}
        held = mon.board.worker_info("multi")
        assert held is not None and held.held() == {m: tuple(i.slices) for m, i in infos.items()}, (
            "its heartbeat lists both slices"
        )
        # one inbox, jobs of both models interleaved
        jobs = [_job(infos[m], f"{m}-{i}", "c0", seed=i) for i in range(3) for m in infos]
        _served_as_local(
            r,
            keys,
            kids,
            "multi",
            jobs,
            lambda job: _local(two_models[job.model], infos[job.model], job),
        )
        # killed: the monitor reaps both of its slices at once
        kids.procs["multi"].send_signal(signal.SIGKILL)
        wait_for(lambda: not r.exists(keys.worker_heartbeat("multi")), 10, "the beat to lapse")
        assert mon.reap(*infos) == ["multi"]
        assert all(mon.board.assignments(m) == {} for m in infos)
        assert all(
            mon.board.slice_demand(m)[next(iter(i.slices))].coverage == 0 for m, i in infos.items()
        )
    finally:
        kids.stop_all()


def test_a_budget_that_fits_one_slice_holds_exactly_one(
    settings: Settings, two_models: dict[str, Path], run_in_thread: Callable[[Any], Any]
) -> None:
    s = settings.model_copy(update={"slice_experts": 8, "volunteer_poll_s": 0.05})
    mon, infos = _register(s, two_models)
    sizes = {m: next(iter(i.slices.values())).nbytes for m, i in infos.items()}
    biggest = max(sizes.values())
    assert sum(sizes.values()) > biggest, "either fits, both do not"
    s = s.model_copy(update={"worker_memory_gib": biggest / GIB})
    w = Worker.from_settings(s, "small")
    run_in_thread(w)
    wait_for(lambda: w.holding is not None, 30, "a first slice")
    time.sleep(1.0)  # twenty volunteer polls
    assert len(w.holdings) == 1, w.holdings
    (held,) = w.holdings
    other = next(m for m in infos if m != held.model)
    assert mon.board.assignments(other) == {}, "no reservation for a slice that cannot fit"
    assert mon.board.slice_demand(other)[next(iter(infos[other].slices))].demand == 1
    # a second worker takes it: the demand was left on the market
    w2 = Worker.from_settings(s, "second")
    run_in_thread(w2)
    wait_for(lambda: w2.holding is not None, 30, "the other slice")
    assert w2.holding is not None and w2.holding.model == other


def test_a_full_worker_gives_back_a_slice_whose_answer_was_lost(
    settings: Settings, two_models: dict[str, Path], run_in_thread: Callable[[Any], Any]
) -> None:
    """A worker whose budget is full never asks for more, so a reservation made for it whose
    answer never reached it (listed for it in the workers hash, unknown to it) would count
    toward the slice's target until it left. It now gives such a slice back at its
    heartbeat's pace, and the slice's demand is on the market again."""
    s = settings.model_copy(update={"slice_experts": 8, "volunteer_poll_s": 0.05})
    mon, infos = _register(s, two_models)
    biggest = max(next(iter(i.slices.values())).nbytes for i in infos.values())
    w = Worker.from_settings(s.model_copy(update={"worker_memory_gib": biggest / GIB}), "full")
    run_in_thread(w)
    wait_for(lambda: w.holding is not None, 30, "a first slice")
    (held,) = w.holdings
    other = next(m for m in infos if m != held.model)
    sid = next(iter(infos[other].slices))
    assert mon.board.volunteer(other, "full") == sid  # reserved for it; the answer is lost
    assert mon.board.slice_demand(other)[sid].demand == 0
    wait_for(lambda: mon.board.assignments(other) == {}, 15, "the lost reservation given back")
    assert mon.board.slice_demand(other)[sid].demand == 1
    assert w.holdings == [held], "and it took nothing new"


def test_through_the_monitor_a_worker_takes_a_slice_of_each_model(
    settings: Settings, two_models: dict[str, Path], run_in_thread: Callable[[Any], Any]
) -> None:
    s = settings.model_copy(
        update={
            "slice_experts": 8,
            "volunteer_poll_s": 0.05,
            "monitor_poll_s": 0.1,
            "monitor_lease_s": 1.0,
            "worker_market": "monitor",
            "market_wait_s": 1.0,
        }
    )
    mon, infos = _register(s, two_models)
    run_in_thread(mon)
    w = Worker.from_settings(s, "via-monitor")
    run_in_thread(w)
    wait_for(lambda: len(w.holdings) == 2, 60, "a slice of each model through the monitor")
    assert {h.model for h in w.holdings} == set(infos)
    r, asks = mon.board.r, Keys(s.prefix).worker_asks("via-monitor")
    # the worker may ask again once it holds both (it has room): the monitor answers each ask
    # and deletes it, so the stream empties; a checked instant could hold one just sent
    wait_for(lambda: not r.xrange(asks), 10, "every ask answered")


def test_wind_down_is_per_slice(
    settings: Settings, two_models: dict[str, Path], run_in_thread: Callable[[Any], Any]
) -> None:
    """K10 per slice: the idle slice covered beyond its target goes back, the one still needed
    stays, and so do the worker's heartbeat and inbox; a job for the slice given back is
    answered with an error."""
    s = settings.model_copy(
        update={
            "slice_experts": 8,
            "volunteer_poll_s": 0.05,
            "idle_release_s": 0.3,
        }
    )
    mon, infos = _register(s, two_models)
    keys, r = Keys(s.prefix), mon.board.r
    w = Worker.from_settings(s, "winder")
    run_in_thread(w)
    wait_for(lambda: len(w.holdings) == 2, 60, "a slice of each model")
    alpha = next(iter(infos["alpha"].slices))
    mon.board.set_target("alpha", alpha, 0)  # alpha's load drained
    # the worker's thread gives the slice back, then frees its server: wait for both
    wait_for(
        lambda: len(w.holdings) == 1 and w.shelf.models() == {"beta"},
        30,
        "alpha's slice released and its server dropped",
    )
    assert w.holdings[0].model == "beta"
    assert mon.board.assignments("alpha") == {} and "winder" in mon.board.assignments("beta")
    assert r.exists(keys.worker_heartbeat("winder")), "its keys stay with its other slice"
    wait_for(
        lambda: (
            (i := mon.board.worker_info("winder")) is not None
            and i.held() == {"beta": tuple(infos["beta"].slices)}
        ),
        10,
        "a beat without alpha",
    )
    time.sleep(1.0)  # twenty volunteer polls in which it must keep beta
    assert len(w.holdings) == 1, "beta is still wanted: it stays"
    job = _job(infos["alpha"], "late", "c1", seed=0)
    r.xadd(keys.worker_inbox("winder"), wire.encode(job))
    out = keys.worker_results("winder", "c1")
    wait_for(lambda: "late" in _results(r, out), 10, "an answer to a job for a slice given back")
    res = _results(r, out)["late"]
    assert (
        res.error is not None
        and res.error.type == "BadJob"
        and "no slice of alpha" in (res.error.message)
    )


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One one-layer model of 8 experts: two slices of 4 experts each."""
    path = tmp_path_factory.mktemp("one") / "gamma.gguf"
    make_tiny(path, layers=1, experts=8, seed=13)
    return path


@pytest.mark.slow
def test_one_worker_process_serves_two_slices_of_one_model_from_one_inbox(
    settings: Settings, two_slices: Path, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"slice_experts": 4, "heartbeat_ttl_s": 1.5})
    mon = Monitor.from_settings(s)
    info = mon.register("gamma", two_slices)
    sids = sorted(info.slices)
    assert len(sids) == 2
    keys, r = Keys(s.prefix), mon.board.r
    fits_both = sum(info.slices[x].nbytes for x in sids) / GIB
    env = child_env(s, worker_market="direct", worker_memory_gib=fits_both) | {
        "OMP_NUM_THREADS": "1"
    }
    kids = Children(env, log_dir=str(tmp_path))
    try:
        kids.spawn("pair", "worker", "--id", "pair")
        kids.wait_for(
            lambda: _ready_slices(mon, "gamma", "pair") == set(sids),
            90,
            "one worker serving both slices of one model",
        )
        assert mon.board.assignments("gamma") == {"pair": tuple(sids)}
        beat = mon.board.worker_info("pair")
        assert beat is not None and beat.held() == {"gamma": tuple(sids)}
        assert r.hget(keys.model_workers("gamma"), "pair") == ",".join(sids).encode()
        jobs = [_job(info, f"{sid}-{i}", "c0", seed=i, sid=sid) for i in range(3) for sid in sids]
        _served_as_local(r, keys, kids, "pair", jobs, lambda job: _local(two_slices, info, job))
        kids.procs["pair"].send_signal(signal.SIGKILL)
        wait_for(lambda: not r.exists(keys.worker_heartbeat("pair")), 10, "the beat to lapse")
        assert mon.reap("gamma") == ["pair"]
        assert mon.board.assignments("gamma") == {}
        assert all(d.coverage == 0 for d in mon.board.slice_demand("gamma").values())
    finally:
        kids.stop_all()


def test_a_budget_that_fits_one_slice_of_a_model_holds_exactly_one_of_it(
    settings: Settings, two_slices: Path, run_in_thread: Callable[[Any], Any]
) -> None:
    s = settings.model_copy(update={"slice_experts": 4, "volunteer_poll_s": 0.05})
    mon = Monitor.from_settings(s)
    info = mon.register("gamma", two_slices)
    biggest = max(spec.nbytes for spec in info.slices.values())
    w = Worker.from_settings(s.model_copy(update={"worker_memory_gib": biggest / GIB}), "one")
    run_in_thread(w)
    wait_for(lambda: w.holding is not None, 30, "a first slice")
    time.sleep(1.0)  # twenty volunteer polls
    assert len(w.holdings) == 1, w.holdings
    (held,) = w.holdings
    assert mon.board.assignments("gamma") == {"one": (held.sid,)}, "nothing else reserved"
    other = next(x for x in info.slices if x != held.sid)
    assert mon.board.slice_demand("gamma")[other].demand == 1


def test_a_worker_takes_many_small_slices_of_one_model_within_seconds(
    settings: Settings,
    tmp_path: Path,
    run_in_thread: Callable[[Any], Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """16 slices of one model (1 layer x 32 experts, 2 experts a slice): each load is followed
    at once by the next ask, not by a heartbeat's wait. The log says "serving" once a slice;
    only the first slice also logs its loading and its bank (64 slices, 320 lines before)."""
    caplog.set_level("INFO", logger="kvq")
    path = tmp_path / "many.gguf"
    make_tiny(path, layers=1, experts=32, hidden=16, expert_ffn=16, seed=14)
    s = settings.model_copy(update={"slice_experts": 2, "volunteer_poll_s": 0.5})
    mon = Monitor.from_settings(s)
    info = mon.register("many", path)
    assert len(info.slices) == 16
    w = Worker.from_settings(s, "greedy")
    run_in_thread(w)
    t0 = time.monotonic()
    wait_for(lambda: len(w.holdings) == 16, 30, "all 16 slices")
    took = time.monotonic() - t0
    assert took < 15, f"{took:.1f}s for 16 slices"
    assert mon.board.assignments("many") == {"greedy": tuple(sorted(info.slices))}
    assert all(d.demand == 0 for d in mon.board.slice_demand("many").values())
    info_lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    for word, n in (("serving many", 16), ("loading many", 1), ("bank: ", 1)):
        got = [m for m in info_lines if m.startswith(word)]
        assert len(got) == n, (word, got)


def test_through_the_monitor_a_worker_takes_both_slices_of_one_model(
    settings: Settings, two_slices: Path, run_in_thread: Callable[[Any], Any]
) -> None:
    s = settings.model_copy(
        update={
            "slice_experts": 4,
            "volunteer_poll_s": 0.05,
            "monitor_poll_s": 0.1,
            "monitor_lease_s": 1.0,
            "worker_market": "monitor",
            "market_wait_s": 1.0,
        }
    )
    mon = Monitor.from_settings(s)
    info = mon.register("gamma", two_slices)
    run_in_thread(mon)
    w = Worker.from_settings(s, "via-monitor")
    run_in_thread(w)
    wait_for(lambda: len(w.holdings) == 2, 60, "both slices through the monitor")
    assert {h.sid for h in w.holdings} == set(info.slices)
    assert mon.board.assignments("gamma") == {"via-monitor": tuple(sorted(info.slices))}


def _ready_slices(mon: Monitor, model: str, worker: str) -> set[str]:
    return {
        v.slice_id
        for v in mon.board.workers(model)
        if v.worker_id == worker and v.alive and v.ready
    }


class _HeldBackHandler(http.server.SimpleHTTPRequestHandler):
    """Range GETs answered only once the class's `go` event is set."""

    go = threading.Event()

    def do_GET(self) -> None:  # http.server's naming
        self.go.wait(30)
        data = Path(self.translate_path(self.path)).read_bytes()
        start, end = (int(p) for p in self.headers["Range"].removeprefix("bytes=").split("-"))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end + 1 - start))
        self.end_headers()
        self.wfile.write(data[start : end + 1])

    def log_message(self, *args: object) -> None:
        pass


def test_a_second_slice_loads_beside_the_serving_of_the_first(
    settings: Settings, two_models: dict[str, Path], run_in_thread: Callable[[Any], Any]
) -> None:
    """While beta's bytes are held back by its server, alpha's jobs are answered, and beta is
    not routable; once they come, beta serves too."""
    s = settings.model_copy(update={"slice_experts": 8, "volunteer_poll_s": 0.05})
    handler = functools.partial(_HeldBackHandler, directory=str(two_models["beta"].parent))
    _HeldBackHandler.go = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        mon = Monitor.from_settings(s)
        alpha = mon.register("alpha", two_models["alpha"])
        beta_url = f"http://127.0.0.1:{srv.server_address[1]}/beta.gguf"
        beta = mon.register("beta", two_models["beta"], source=beta_url)
        (sb,) = beta.slices
        mon.board.set_target("beta", sb, 0)  # alpha first
        keys, r = Keys(s.prefix), mon.board.r
        w = Worker.from_settings(s, "both")
        run_in_thread(w)
        wait_for(lambda: w.holding is not None, 30, "alpha")
        mon.board.set_target("beta", sb, 1)
        wait_for(lambda: w.membership.loading is not None, 10, "beta to be loading")
        assert not _ready(mon, "beta", "both") and _ready(mon, "alpha", "both")
        job = _job(alpha, "during", "c2", seed=5)
        r.xadd(keys.worker_inbox("both"), wire.encode(job))
        out = keys.worker_results("both", "c2")
        wait_for(lambda: "during" in _results(r, out), 10, "alpha's job answered while loading")
        assert w.membership.loading is not None, "beta is still loading"
        _HeldBackHandler.go.set()
        wait_for(lambda: len(w.holdings) == 2, 30, "beta loaded")
        wait_for(lambda: _ready(mon, "beta", "both"), 10, "beta routable")
        job_b = _job(beta, "after", "c2", seed=6)
        r.xadd(keys.worker_inbox("both"), wire.encode(job_b))
        wait_for(lambda: "after" in _results(r, out), 10, "beta's job answered")
        res = _results(r, out)["after"]
        assert res.error is None and res.y is not None
        assert np.array_equal(res.y.array(), _local(two_models["beta"], beta, job_b))
    finally:
        _HeldBackHandler.go.set()
        srv.shutdown()
        srv.server_close()
