"""Verified results with graded trust, end to end (issue 11 items 3 and 4).

A real `kvq worker` process lies (`liar_worker.py`: well-formed results, wrong numbers, on every
job or on 10% of them, or NaN); an honest one holds the other layer. The coordinator holds no
experts (`KVQ_COORDINATOR_EXPERTS=none`), so every job goes to a worker, and checks results by
recomputing them from the memory-mapped file. The liar must be caught on its first lie, within
100 of its jobs, quarantined in Redis (and so in the monitor's API and metrics), and every
generated token must equal the all-local reference: no lie is ever used.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from e2e_helpers import local_tokens, wait_ready

from kvq import client, wire
from kvq.config import Settings, child_env
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor import Monitor
from kvq.monitor.http import Api
from kvq.quant import qdot
from kvq.worker import Worker

pytestmark = pytest.mark.slow
LIAR = Path(__file__).with_name("liar_worker.py")
PROMPTS = [
    "liars get caught",
    "the quick brown fox",
    "trust but verify",
    "kvq",
    "MoE",
    "spot checks",
    "graded trust",
    "no garbage",
    "ten percent",
    "a hundred jobs",
]
MAX_TOKENS = 12


@pytest.fixture
def s(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "coordinator_experts": "none",  # every job remote, checked from the mapped file
            "slice_experts": 8,  # one slice per layer: the liar holds one, the honest one the other
            "worker_max_slices": 1,  # (a worker's budget would fit both)
            "job_deadline_ms": 10_000,
            "gpu_workers": "*",  # GPU paths' tolerances are tested (not admission: its own test)
        }
    )


@pytest.fixture
def kids(s: Settings, tmp_path: Path) -> Iterator[Children]:
    k = Children(child_env(s), log_dir=str(tmp_path))
    yield k
    k.stop_all()


def _spawn_liar(
    kids: Children,
    s: Settings,
    tmp_path: Path,
    wid: str,
    garbage: float,
    seed: int,
    kind: str = "noise",
    honest_first: int = 0,
    extra: tuple[str, ...] = (),
) -> None:
    log = (tmp_path / f"{wid}.log").open("wb")
    kids.procs[wid] = subprocess.Popen(
        [
            sys.executable,
            str(LIAR),
            "--id",
            wid,
            "--garbage",
            str(garbage),
            "--seed",
            str(seed),
            "--kind",
            kind,
            "--honest-first",
            str(honest_first),
            *extra,
        ],
        env=child_env(s),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()


def _start(
    s: Settings,
    kids: Children,
    run_in_thread,
    model: Path,
    first: str,
    spawn_first,
    coord_s: Settings | None = None,
) -> tuple[Monitor, Coordinator]:  # type: ignore[no-untyped-def]
    """Register, start `first` (it takes layer 0's slice), then an honest worker, then the
    coordinator (with `coord_s` if given)."""
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", model)
    spawn_first()
    kids.wait_for(
        lambda: mon.board.assignments("tiny").get(first) == (min(info.slices),),
        60,
        f"{first} holding layer 0",
    )
    kids.spawn("honest", "worker", "--id", "honest")
    wait_ready(mon, "tiny", 2)
    coord = Coordinator.from_settings(coord_s or s, "c1", "tiny", model)
    run_in_thread(coord)
    return mon, coord


def _generate_until_caught(
    r: redis.Redis, keys: Keys, board_quarantined, model: Path, suspect: str
) -> int:  # type: ignore[no-untyped-def]
    """Requests one at a time, each checked against all-local generation, until `suspect`
    is quarantined; how many requests it took."""
    for n, prompt in enumerate(PROMPTS, start=1):
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 60) if e.token_id is not None]
        assert got == local_tokens(model, prompt, MAX_TOKENS), prompt
        if suspect in board_quarantined("tiny"):
            return n
    raise AssertionError(f"{suspect} not caught after {len(PROMPTS)} requests")


def _until_caught(
    mon: Monitor, keys: Keys, want: dict[str, list[int]], liar: str, limit: int
) -> tuple[int, int]:
    """Requests one at a time (the prompts of `want` in turn), each compared with its
    all-local tokens, until `liar` is quarantined; (requests, wrong completions)."""
    r, requests, wrong = mon.board.r, 0, 0
    prompts = list(want)
    while liar not in mon.board.quarantined("tiny"):
        assert requests < limit, f"{liar} not caught within {limit} requests"
        prompt = prompts[requests % len(prompts)]
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
        requests += 1
        wrong += got != want[prompt]
    return requests, wrong


def _lies(tmp_path: Path, wid: str) -> int:
    return len(re.findall(r"LIE job", (tmp_path / f"{wid}.log").read_text()))


@pytest.mark.parametrize(
    ("garbage", "seed", "kind", "verify"),
    [(1.0, 0, "noise", "sampled"), (0.1, 0, "noise", "sampled"), (1.0, 0, "nan", "off")],
    ids=["every-job", "ten-percent", "nan-with-verification-off"],
)
def test_a_liar_is_caught_and_its_garbage_never_used(
    s: Settings,
    kids: Children,
    run_in_thread,
    tiny_model: Path,
    tmp_path: Path,
    garbage: float,
    seed: int,
    kind: str,
    verify: str,
) -> None:
    s = s.model_copy(update={"verify_remote": verify})
    mon, coord = _start(
        s,
        kids,
        run_in_thread,
        tiny_model,
        "liar",
        lambda: _spawn_liar(kids, s, tmp_path, "liar", garbage, seed, kind),
    )
    _generate_until_caught(mon.board.r, Keys(s.prefix), mon.board.quarantined, tiny_model, "liar")
    verdict = mon.board.quarantined("tiny")["liar"]
    assert verdict.active(time.time() * 1000) and verdict.coord == "c1" and not verdict.banned
    t = coord.trust.workers["liar"]
    print(
        f"{kind} liar ({garbage:.0%}): caught at its result {t.checked}, after "
        f"{t.checked - 1} verified ones; lies told {_lies(tmp_path, 'liar')}"
    )
    assert t.mismatches == 1 and t.checked <= 100, "caught within 100 of its jobs"
    assert _lies(tmp_path, "liar") == 1, "caught on its first lie: no lie was ever used"
    st = coord.dispatch.stats
    if kind == "nan":
        assert st.nonfinite_results == 1 and st.verified == 0, "refused with checks off"
    else:
        assert st.mismatches == 1 and st.verified >= t.checked
    assert st.quarantines == 1 and "honest" not in mon.board.quarantined("tiny")
    api = Api(mon.board)
    (entry,) = api.trust()["models"]
    assert [(w["worker"], w["quarantined"]) for w in entry["workers"]] == [("liar", True)]
    assert 'kvq_worker_quarantined{model="tiny",worker="liar"} 1.0' in api.metrics().decode()
    # quarantined: no work, no result used; the model is refused until the slice is covered
    assert coord.routing.trust.barred("liar")


@pytest.mark.parametrize("honest_first", [0, 300], ids=["from-its-first-job", "after-300-honest"])
def test_a_one_in_a_hundred_liar_is_caught_and_each_lie_escapes_at_most_as_stated(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path, honest_first: int
) -> None:
    """X3, the default schedule (`sampled`) against a worker lying on 1 job in 100. Each lie
    is checked with probability at least the step floor's per job (0.3 at one job a step, the
    tiny model's): it escapes with probability at most 0.7 (`docs/security.md`). Requests one
    at a time until it is caught; the lies it told, those used (all but the one caught), and
    wrong completions are printed: the measured escape per lie beside the stated bound."""

    def liar() -> None:
        _spawn_liar(kids, s, tmp_path, "liar", 0.01, 7, honest_first=honest_first)

    mon, coord = _start(s, kids, run_in_thread, tiny_model, "liar", liar)
    want = {p: local_tokens(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
    requests, wrong = _until_caught(mon, Keys(s.prefix), want, "liar", 250)
    lies, t = _lies(tmp_path, "liar"), coord.trust.workers["liar"]
    per_step = coord.trust.per_step.get("liar", 0.0)
    print(
        f"1-in-100 liar (honest first {honest_first}): {lies} lies, {lies - 1} used before "
        f"the catch at its check {t.checked}; {wrong} wrong of {requests} requests; "
        f"jobs/step {per_step:.2f}"
    )
    assert lies >= 1 and t.mismatches == 1
    assert wrong <= lies - 1, "only a lie that escaped can spoil a completion"


@pytest.mark.parametrize("seed", [0, 1])
def test_trust_cannot_be_banked_a_late_liar_spoils_at_most_one_completion(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path, seed: int
) -> None:
    """Issue 32 item 4. The liar answers its first 300 jobs honestly (its streak takes it to
    the 2% floor, where a late lie used to go unchecked for about 50 jobs: 4 of 16 requests
    wrong), then lies on every job. Requests one at a time, each compared with all-local
    generation: at most 1 of them is wrong before the step floor's check catches it."""
    honest_first = 300
    mon, coord = _start(
        s,
        kids,
        run_in_thread,
        tiny_model,
        "liar",
        lambda: _spawn_liar(kids, s, tmp_path, "liar", 1.0, seed, honest_first=honest_first),
    )
    want = {p: local_tokens(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
    requests, wrong = _until_caught(mon, Keys(s.prefix), want, "liar", 100)
    lies = _lies(tmp_path, "liar")
    t = coord.trust.workers["liar"]
    print(
        f"late liar (seed {seed}): honest for {honest_first} jobs, caught after {lies} lies "
        f"at its check {t.checked}; {wrong} wrong of {requests} requests; "
        f"jobs/step {coord.trust.per_step.get('liar', 0):.2f}"
    )
    assert lies >= 1, "it did start lying before the catch"
    assert wrong <= 1 and requests <= 100


def test_an_impersonator_is_caught_but_blamed_on_the_worker_whose_stream_it_writes(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path
) -> None:
    """A process that can read an honest worker's inbox and write its results stream (no ACL
    users here) answers its jobs first, with garbage. Results are attributed by the stream they
    arrive in, so the lie is checked as the honest worker's: caught and never used, but the
    honest worker takes the blame. With `kvq acl` users only the worker can write its stream
    (`docs/security.md`, "Bound identity")."""
    keys = Keys(s.prefix)
    stop = threading.Event()
    mon, coord = _start(
        s,
        kids,
        run_in_thread,
        tiny_model,
        "victim",
        lambda: kids.spawn("victim", "worker", "--id", "victim"),
    )
    r = redis.Redis.from_url(s.redis_url)
    t = threading.Thread(target=_impersonate, args=(r, keys, "victim", stop), daemon=True)
    t.start()
    try:
        _generate_until_caught(mon.board.r, keys, mon.board.quarantined, tiny_model, "victim")
    finally:
        stop.set()
        t.join(5)
        r.close()
    assert coord.trust.workers["victim"].mismatches == 1
    assert "honest" not in mon.board.quarantined("tiny")


def _impersonate(r: redis.Redis, keys: Keys, victim: str, stop: threading.Event) -> None:
    last = "$"
    inbox = keys.worker_inbox(victim)
    while not stop.is_set():
        got = r.xread({inbox: last}, count=16, block=100)
        for _, entries in got or []:
            for eid, fields in entries:
                last = eid
                job = wire.decode(fields, wire.Job)
                y = wire.Tensor.of(job.x.array() * 3.0)  # well-formed, wrong
                res = wire.Result(job_id=job.job_id, worker="mallory", y=y)
                r.xadd(keys.worker_results(victim, job.coord), wire.encode(res))


def test_an_honest_bfloat16_worker_is_never_flagged(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path
) -> None:
    """A worker computing in bfloat16 (what a CUDA worker does with BF16 weights) differs from
    the coordinator's float32 by rounding: checked through its full-check phase and into
    sampling, it is never flagged (the 10,000-job claim is `tests/coordinator/test_check.py`)."""
    bf16 = child_env(s.model_copy(update={"compute_dtype": "bfloat16"}))
    mon, coord = _start(
        s,
        kids,
        run_in_thread,
        tiny_model,
        "bf16",
        lambda: kids.spawn("bf16", "worker", "--id", "bf16", env=bf16),
    )
    keys, r = Keys(s.prefix), mon.board.r
    want = s.trust_full_checks + 100
    for i in range(40):
        if coord.dispatch.per_worker.get("bf16", 0) >= want:
            break
        rid = client.send(r, keys, "tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS)
        events = list(client.events(r, keys, rid, 60))
        assert events[-1].kind == "done", events[-1]
    results = coord.dispatch.per_worker.get("bf16", 0)
    t = coord.trust.workers["bf16"]
    st = coord.dispatch.stats
    print(
        f"bf16 worker: {results} results, {t.checked} checked, none flagged; largest "
        f"difference {st.max_abs_err:.3g}"
    )
    assert results >= want and t.mismatches == 0 and st.mismatches == 0
    assert t.checked >= s.trust_full_checks and t.checked < results, "sampling has begun"
    assert st.max_abs_err > 0, "its results did differ from float32"
    assert mon.board.quarantined("tiny") == {}


def test_checks_cost_what_the_schedule_says_once_trust_is_earned(
    s: Settings, run_in_thread, tiny_model: Path
) -> None:
    """Two honest workers (threads), every job remote: after each has sent 1,100 results
    (trust earned: the streak's p at its 2% floor), the rows recomputed to check results are
    the share the step floor sets for their jobs per step (`kvq.coordinator.trust`): on the
    tiny model a worker gets about one job per step, so about 30%; a real model's worker,
    with jobs on many layers per step, pays p_min's 2% (tests/coordinator/test_trust.py)."""
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    workers = [Worker.from_settings(s, f"w{i}") for i in range(2)]
    for w in workers:
        run_in_thread(w)
    wait_ready(mon, "tiny", 2)
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    keys, r, st = Keys(s.prefix), mon.board.r, coord.dispatch.stats

    def jobs() -> int:
        return min(coord.dispatch.per_worker.get(f"w{i}", 0) for i in range(2))

    snap: tuple[int, int] | None = None
    while jobs() < 2_100:
        rid = client.send(r, keys, "tiny", prompt="what checks cost", max_tokens=48)
        assert list(client.events(r, keys, rid, 120))[-1].kind == "done"
        if snap is None and jobs() >= 1_100:
            snap = (st.remote_rows, st.verified_rows)
    assert snap is not None
    share = (st.verified_rows - snap[1]) / (st.remote_rows - snap[0])
    policy, trust = coord.trust.policy, coord.trust
    predicted = sum(trust.p(f"w{i}") for i in range(2)) / 2
    print(
        f"once trusted: {share:.4f} of remote rows recomputed (the schedule says "
        f"{predicted:.4f}; jobs per step {[round(trust.per_step[f'w{i}'], 2) for i in range(2)]}); "
        f"from the start {st.verified_rows / st.remote_rows:.4f}"
    )
    assert st.mismatches == 0
    assert all(trust.workers[f"w{i}"].ok > policy.full_checks + 100 for i in range(2))
    assert policy.p_min <= predicted <= policy.step_floor + 0.01
    assert share == pytest.approx(predicted, rel=0.35)


# path -> (the liar's KVQ_COMPUTE_DTYPE, everyone's KVQ_ACTIVATIONS, model quant, the label it
# puts on its results); "q8" is float32 weights or quantized ones times int8 activations
LIAR_PATHS = {
    "float32": ("float32", "float32", "f32", None),  # the exact path, tolerance 1e-3
    "q8 (f32 weights)": ("auto", "int8", "f32", None),  # the default: bitwise
    "q8 (Q4_K)": ("auto", "int8", "q4_k_m", None),
    "bfloat16": ("bfloat16", "int8", "f32", None),  # a GPU's path: row and bias tolerances
    "float16": ("float16", "int8", "f32", None),
    "float32 labelled bfloat16": ("float32", "float32", "f32", "bfloat16"),  # its own tolerance
    "q8 labelled bfloat16": ("auto", "int8", "q4_k_m", "bfloat16"),
}


@pytest.fixture(scope="module")
def tiny_q4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvq.tools.synth import make_tiny

    path = tmp_path_factory.mktemp("models") / "tiny-q4k.gguf"
    make_tiny(
        path,
        layers=2,
        experts=8,
        experts_used=2,
        hidden=256,
        expert_ffn=256,
        quant="q4_k_m",
        seed=3,
    )
    return path


@contextmanager
def _activations(kind: str) -> Iterator[None]:
    """This process's kernels (the coordinator's thread, the reference) on `kind`."""
    before = qdot.options()
    qdot.configure(replace(before, activations=kind))
    try:
        yield
    finally:
        qdot.configure(before)


@pytest.mark.parametrize("factor", [1.01, 1.05])
@pytest.mark.parametrize("path", list(LIAR_PATHS))
def test_the_liar_table_a_scaled_result_is_caught_on_every_path(
    s: Settings,
    kids: Children,
    run_in_thread,
    tiny_model: Path,
    tiny_q4k: Path,
    tmp_path: Path,
    path: str,
    factor: float,
) -> None:
    """Issue 32 item 3, the report's table rerun with real processes: a worker whose every
    result is its honest one times `factor` (1.01 hides inside bfloat16's one-job spread), on
    each compute path the coordinator can ask for, labelled as the worker likes. The
    coordinator decides the path and the check (bitwise for q8, tolerances for the rest) and
    refuses a label it did not ask for. Requests one at a time until the liar is quarantined,
    each compared with all-local generation on the coordinator's path."""
    dtype, acts, quant, label = LIAR_PATHS[path]
    model = tiny_q4k if quant == "q4_k_m" else tiny_model
    if acts == "float32":  # (int8 is the default; a GPU dtype refuses it named explicitly)
        s = s.model_copy(update={"activations": acts})
    liar_s = s.model_copy(update={"compute_dtype": dtype})
    extra = ("--factor", str(factor), *(("--label", label) if label else ()))
    with _activations(acts):
        want = {p: local_tokens(model, p, MAX_TOKENS) for p in PROMPTS}
        mon, coord = _start(
            s,
            kids,
            run_in_thread,
            model,
            "liar",
            lambda: _spawn_liar(kids, liar_s, tmp_path, "liar", 1.0, 0, "scale", extra=extra),
        )
        requests, wrong = _until_caught(mon, Keys(s.prefix), want, "liar", 40)
    t, lies = coord.trust.workers["liar"], _lies(tmp_path, "liar")
    asked = coord.dispatch.verifier.asked("liar")
    print(
        f"LIAR-TABLE | {path} | x{factor} | asked {asked} | caught at check {t.checked} | "
        f"{lies} lies | {wrong} wrong of {requests} requests |"
    )
    assert t.mismatches == 1 and "honest" not in mon.board.quarantined("tiny")
    if dtype in ("float32", "auto") or label:  # exact, bitwise, or the wrong label: first lie
        assert lies == 1 and wrong == 0
    else:  # a GPU path's tolerance: a 1% lie may pass one job, not the running mean bias
        assert lies <= 8


@pytest.mark.parametrize("factor", [0.028, 0.015])
def test_a_gpu_path_claim_cannot_hide_orthogonal_noise_under_its_tolerance(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path, factor: float
) -> None:
    """X3, a GPU path claim. A worker that says it computes in bfloat16 is held to bfloat16's 3% row
    tolerance; it adds noise orthogonal to each row (no bias to see) at `factor` of the row's
    norm, under that tolerance. The mean row error over its last 8 checked results is not
    honest rounding's (0.0055-0.007): it is caught within its full-check phase, where every
    result is recomputed before use, so no completion is wrong. The coordinator computes in
    float32 here, so that every token can be compared with all-local generation."""
    s = s.model_copy(update={"activations": "float32"})
    liar_s = s.model_copy(update={"compute_dtype": "bfloat16"})
    with _activations("float32"):
        want = {p: local_tokens(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
        mon, coord = _start(
            s,
            kids,
            run_in_thread,
            tiny_model,
            "liar",
            lambda: _spawn_liar(
                kids, liar_s, tmp_path, "liar", 1.0, 0, "ortho", extra=("--factor", str(factor))
            ),
        )
        requests, wrong = _until_caught(mon, Keys(s.prefix), want, "liar", 40)
    t, lies = coord.trust.workers["liar"], _lies(tmp_path, "liar")
    asked = coord.dispatch.verifier.asked("liar")
    why = mon.board.quarantined("tiny")["liar"].reason
    print(
        f"LIAR-TABLE | bfloat16 claim, orthogonal noise {factor:.1%} | asked {asked} | caught "
        f"at check {t.checked} | {lies} lies | {wrong} wrong of {requests} requests | {why}"
    )
    assert asked == "bfloat16" and "row error" in why
    assert t.checked <= s.trust_full_checks and wrong == 0
    assert set(mon.board.quarantined("tiny")) == {"liar"}


def test_a_worker_not_admitted_to_a_gpu_path_cannot_claim_one(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path
) -> None:
    """X3, KVQ_GPU_WORKERS: a worker the operator did not admit says it computes in bfloat16
    (as a CPU liar would, to earn bfloat16's tolerance for 0.5% of noise). The coordinator
    keeps asking it for its own path: every job of its fails (`WrongDType`), none of its
    results is used, every completion equals all-local generation."""
    s = s.model_copy(update={"gpu_workers": "honest"})
    liar_s = s.model_copy(update={"compute_dtype": "bfloat16"})

    def liar() -> None:
        _spawn_liar(kids, liar_s, tmp_path, "liar", 1.0, 0, "ortho", extra=("--factor", "0.005"))

    mon, coord = _start(s, kids, run_in_thread, tiny_model, "liar", liar)
    keys, r = Keys(s.prefix), mon.board.r
    for prompt in PROMPTS[:6]:
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 60) if e.token_id is not None]
        assert got == local_tokens(tiny_model, prompt, MAX_TOKENS), prompt
    v = coord.dispatch.verifier
    assert v.asked("liar") == v.local_dtype != "bfloat16"
    assert coord.dispatch.per_worker.get("liar", 0) == 0 and _lies(tmp_path, "liar") == 0
    assert coord.dispatch.per_worker.get("honest", 0) > 0


# stage grain (X12): the liar holds a layer span whole; path -> (model quant, the lie, factor)
STAGE_LIARS = {
    "stage f32, noise": ("f32", "noise", 1.0),
    "stage f32, x1.01": ("f32", "scale", 1.01),
    "stage Q4_K, x1.05": ("q4_k_m", "scale", 1.05),
    # inside float32's tolerance (1e-3, no bias): caught as both holders carry one numerics label
    "stage Q4_K, 0.01 % orthogonal noise (one CPU kind)": ("q4_k_m", "ortho", 1e-4),
}


def _start_stage(
    s: Settings, kids: Children, run_in_thread, model: Path, tmp_path: Path, *liar: str
) -> tuple[Settings, Monitor, Coordinator]:  # type: ignore[no-untyped-def]
    """`model` at stage grain, one block a span, two holders of each: the liar (`liar`:
    liar_worker.py's arguments) holds the first span, three honest workers the rest."""
    s = s.model_copy(
        update={"grain": "stage", "stage_layers": 1, "base_replicas": 2, "backbone_replicas": 2}
    )
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", model)
    assert info.grain == "stage" and len(info.stages()) == 2
    log = (tmp_path / "liar.log").open("wb")
    kids.procs["liar"] = subprocess.Popen(
        [sys.executable, str(LIAR), "--id", "liar", *liar],
        env=child_env(s),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    kids.wait_for(
        lambda: mon.board.assignments("tiny").get("liar") == (min(info.slices),),
        60,
        "the liar holding the first span",
    )
    for w in ("h1", "h2", "h3"):
        kids.spawn(w, "worker", "--id", w)
    wait_ready(mon, "tiny", 4, 120)
    coord = Coordinator.from_settings(s, "c1", "tiny", model)
    return s, mon, coord


@pytest.mark.timeout(600)
@pytest.mark.parametrize("row", list(STAGE_LIARS))
def test_the_liar_table_at_stage_grain_a_lying_span_holder_is_caught_before_use(
    s: Settings,
    kids: Children,
    run_in_thread,
    tiny_model: Path,
    tiny_q4k: Path,
    tmp_path: Path,
    row: str,
) -> None:
    """X3 at stage grain (X12). The model at stage grain, one block a span, two holders of each; the
    liar holds the first span and lies on every stage answer. The coordinator witnesses the
    sequences of a holder it does not trust yet on a second holder of the span and referees
    a disagreement with its own run of the span: the liar is caught on its first lie, every
    completion equals all-local generation, no honest holder is blamed."""
    quant, kind, factor = STAGE_LIARS[row]
    model = tiny_q4k if quant == "q4_k_m" else tiny_model
    want = {p: local_tokens(model, p, MAX_TOKENS) for p in PROMPTS[:4]}
    s, mon, coord = _start_stage(
        s, kids, run_in_thread, model, tmp_path, "--kind", kind, "--factor", str(factor)
    )
    run_in_thread(coord)
    keys, r = Keys(s.prefix), mon.board.r
    wrong = requests = 0
    for prompt in want:
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
        requests += 1
        wrong += got != want[prompt]
    t, lies, st = coord.trust.workers["liar"], _lies(tmp_path, "liar"), coord.dispatch.stats
    print(
        f"LIAR-TABLE | {row} | caught at check {t.checked} | {lies} lies | {wrong} wrong of "
        f"{requests} requests | {st.witness_jobs} witness jobs |"
    )
    assert "liar" in mon.board.quarantined("tiny"), "caught"
    assert wrong == 0 and lies == 1, "caught on its first lie, which was never used"
    assert t.mismatches == 1 and st.mismatches == 1
    assert set(mon.board.quarantined("tiny")) == {"liar"}, "no honest holder blamed"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("verify", ["sampled", "all"])
def test_a_late_liar_at_stage_grain_spoils_few_completions_and_none_when_all_are_witnessed(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path, verify: str
) -> None:
    """The liar answers its first 150 stage jobs honestly (its streak takes it past the full
    checks), then lies on every one. Sampled (the default), each new sequence on its span is
    witnessed with the step floor's probability (0.3): a few completions may be wrong before
    one is witnessed and it is caught. `KVQ_VERIFY_REMOTE=all` witnesses every sequence: none
    is wrong, at twice the span's compute."""
    s = s.model_copy(update={"verify_remote": verify})
    s, mon, coord = _start_stage(
        s, kids, run_in_thread, tiny_model, tmp_path, "--honest-first", "150"
    )
    coord.trust.rng = random.Random(7)
    run_in_thread(coord)
    want = {p: local_tokens(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
    requests, wrong = _until_caught(mon, Keys(s.prefix), want, "liar", 80)
    st = coord.dispatch.stats
    print(
        f"LATE-LIAR stage | verify {verify} | caught after {requests} requests | {wrong} "
        f"wrong | {_lies(tmp_path, 'liar')} lies | {st.witness_jobs} witness jobs of "
        f"{st.remote_sent} |"
    )
    assert set(mon.board.quarantined("tiny")) == {"liar"}
    if verify == "all":
        assert wrong == 0
    else:
        assert wrong <= 12  # P(12 unwitnessed in a row) = 0.7 ** 12 < 1.5%; seeded draws


@pytest.mark.timeout(600)
def test_at_stage_grain_a_third_holder_decides_for_a_backbone_only_coordinator(
    s: Settings, kids: Children, run_in_thread, tiny_model: Path, tmp_path: Path
) -> None:
    """The coordinator runs on a backbone file (no span of its own to referee with): when the
    liar and the honest holder of a span disagree, a third holder of the span replays the
    sequence's inputs chunk by chunk as they ran them (`StageJob.chunks`) and decides. The
    liar is caught at its first lie; every completion equals all-local generation."""
    from kvq.gguf.split import write_backbone

    backbone = tmp_path / "tiny-backbone.gguf"
    write_backbone(tiny_model, backbone)
    s = s.model_copy(
        update={
            "grain": "stage",
            "stage_layers": 1,
            "base_replicas": 3,
            "backbone_replicas": 3,
            "coordinator_experts": "none",
        }
    )
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)
    # "a-liar": first by id among holders no job has priced yet, so the first chain has it
    _spawn_liar(kids, s, tmp_path, "a-liar", 1.0, 0, "noise")
    kids.wait_for(
        lambda: mon.board.assignments("tiny").get("a-liar") == (min(info.slices),),
        60,
        "the liar holding the first span",
    )
    for w in ("h1", "h2", "h3", "h4", "h5"):
        kids.spawn(w, "worker", "--id", w, env=child_env(s))
    wait_ready(mon, "tiny", 6, 180)
    held = {
        sid: sum(v.slice_id == sid and v.ready for v in mon.board.workers("tiny"))
        for sid in info.slices
    }
    assert all(n >= 3 for n in held.values()), held
    coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
    run_in_thread(coord)
    keys, r = Keys(s.prefix), mon.board.r
    wrong = 0
    for prompt in PROMPTS[:3]:
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
        wrong += got != local_tokens(tiny_model, prompt, MAX_TOKENS)
    st = coord.dispatch.stats
    print(
        f"LIAR-TABLE | stage, backbone-only coordinator, third holder decides | "
        f"{_lies(tmp_path, 'a-liar')} lies | {wrong} wrong of 3 | {st.witness_jobs} witness jobs "
        f"| unresolved {st.unresolved} |"
    )
    assert set(mon.board.quarantined("tiny")) == {"a-liar"}
    assert wrong == 0 and _lies(tmp_path, "a-liar") == 1 and st.unresolved == 0
