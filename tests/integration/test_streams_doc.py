"""Every `redis-cli` line of docs/streams.md, run against two deployments.

1. The README's own deployment (`test_the_readme_deployment_returns_what_the_page_says`): the
   `kvq` processes of README's "Running it for real" block, taken from the block itself (model
   made with its `make-tiny` line, then `monitor`, `coordinator`, `worker`, `api`), every
   setting at its default, on this test's Redis. Below each line the page states what it
   returns there, at rest (after the block's `kvq submit`) and under load (during a burst of
   concurrent requests), as `# README: at rest data|empty, under load data|empty|sometimes:
   why`; the test checks each statement. `REQUEST_ID` is the submitted request's id at rest, a
   burst request's under load.
2. A deployment where every line returns data (`test_every_redis_cli_line_returns_data`): the
   README's ids, but every expert job sent to the worker (`KVQ_COORDINATOR_EXPERTS=none`) and
   the worker taking slices through the monitor (`KVQ_WORKER_MARKET=monitor`), so that the
   results and market streams exist; and what a deployment at rest has not got, made the way
   the system makes it: a cancelled request, a dead letter written by `kvq.bus.dead_letter`, a
   departure and a verdict by the board.

Each line is split as a shell would (`shlex`) and sent with redis-py's `execute_command`.
Lines that need another server are named in `ELSEWHERE` with the reason (TLS, a Cluster):
they are checked to be there, not run."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from waiting import wait_for

from kvq import client
from kvq.bus.records import Departure, Quarantine
from kvq.bus.redis_board import open_board
from kvq.bus.streams import dead_letter
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.local.server import free_port
from kvq.tools.synth import make_tiny

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "streams.md"
BURST = 16  # concurrent requests: more than the coordinator's slots
ELSEWHERE = {
    "--tls": "needs a TLS server (tests/bus/test_tls.py)",
    "CLUSTER KEYSLOT": "needs a Redis Cluster (tests/bus/test_shards.py)",
}


def doc_lines() -> list[str]:
    """The `redis-cli ...` lines inside the page's code blocks, comments cut."""
    out, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if inside and line.startswith("redis-cli "):
            out.append(re.sub(r"\s+#.*$", "", line).strip())
    return out


def readme_ids() -> set[str]:
    block = readme_block()
    return set(re.findall(r"--id (\S+)", block)) | set(re.findall(r"--model (\w+)=", block))


def test_the_page_uses_the_readmes_ids() -> None:
    ids = readme_ids()
    assert {"small", "coord-1", "laptop-1"} <= ids, ids
    text = "\n".join(doc_lines())
    for stale in ("tiny", "worker-0", "worker-gpu-3"):
        assert stale not in text, f"docs/streams.md still says {stale!r}: the README deploys {ids}"


CLAIM = re.compile(r"# README: at rest (data|empty), under load (data|empty|sometimes)(?:: (.+))?$")


class Claim(NamedTuple):
    line: str
    rest: str
    load: str
    why: str


def doc_claims() -> list[Claim]:
    """Each `redis-cli` line with the `# README: ...` statement on the line below it."""
    out: list[Claim] = []
    inside, last = False, ""
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            inside, last = not inside, ""
            continue
        if not inside:
            continue
        m = CLAIM.match(line)
        if m and last:
            out.append(Claim(last, m[1], m[2], m[3] or ""))
        last = re.sub(r"\s+#.*$", "", line).strip() if line.startswith("redis-cli ") else ""
    return out


def runnable(line: str) -> bool:
    return not any(mark in line for mark in ELSEWHERE)


def test_every_line_says_what_the_readme_deployment_returns() -> None:
    claims = doc_claims()
    lines = [line for line in doc_lines() if runnable(line)]
    assert [c.line for c in claims] == lines, "a redis-cli line without its '# README:' line"
    vague = [c.line for c in claims if "data" not in (c.rest, c.load) and not c.why]
    vague += [c.line for c in claims if c.load == "sometimes" and not c.why]
    assert not vague, f"empty on the README deployment without saying why: {vague}"


def readme_commands() -> list[list[str]]:
    """The README block's `kvq` commands, in order, but for its Redis server."""
    out = []
    for raw in readme_block().splitlines():
        words = shlex.split(raw, comments=True)
        if words[:1] == ["kvq"] and words[1] in (
            "model",
            "monitor",
            "coordinator",
            "worker",
            "api",
        ):
            out.append([w for w in words[1:] if w != "&"])
    return out


def readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Running it for real", 1)[1].split("```sh", 1)[1].split("```", 1)[0]


def reply_of(r: redis.Redis, raw: redis.Redis, line: str, rid: str) -> Any:
    """What redis-cli would print for `line` (an error as the string `error: ...`)."""
    args = shlex.split(line.replace("REQUEST_ID", rid))[1:]
    if args[:1] == ["--scan"]:  # redis-cli's own SCAN loop
        return list(r.scan_iter(args[args.index("--pattern") + 1], count=1000))
    try:
        return raw.execute_command(*args)
    except redis.ResponseError as exc:  # a key the deployment never made, ...
        return f"error: {exc}"


def is_empty(reply: Any) -> bool:
    """Nothing to see: nil, an empty list, map or string, an error, 0 (`XLEN`, `EXISTS` of
    no key) or -2 (`TTL` of no key)."""
    none = (None, [], {}, b"", 0, -2)
    return any(reply == e and type(reply) is type(e) for e in none) or str(reply).startswith(
        "error:"
    )


def raw_client(r: redis.Redis) -> redis.Redis:
    raw = redis.Redis(connection_pool=r.connection_pool)
    raw.response_callbacks.clear()  # the server's replies as they are, as redis-cli prints them
    return raw


def _burst(url: str, n: int, tokens: int) -> tuple[list[threading.Thread], list[str], list[Any]]:
    """`n` concurrent requests through kvq.client, each read to its end; (threads, ids, errors)."""
    ids: list[str] = []
    errors: list[Any] = []
    sent = threading.Barrier(n + 1)

    def one(i: int) -> None:
        r = redis.Redis.from_url(url)
        try:
            rid = client.send(
                r, Keys("kvq"), "small", prompt=f"Request {i}: hello", max_tokens=tokens
            )
            ids.append(str(rid))
            sent.wait(60)
            for _ in client.events(r, Keys("kvq"), rid, 600):
                pass
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            r.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    sent.wait(60)
    return threads, ids, errors


@pytest.fixture
def readme_deployment(redis_server: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The README block's processes on this test's Redis (prefix `kvq`, defaults otherwise)."""
    if getattr(redis_server, "cluster", False) or "cluster" in type(redis_server).__name__.lower():
        pytest.skip("the README deploys one standalone server")
    r = redis.Redis.from_url(redis_server.url)
    for pattern in ("kvq:*", "rq:*"):  # the README's prefix: this module's keys only
        for k in r.scan_iter(pattern):
            r.delete(k)
    s = Settings(redis_url=redis_server.url)
    # as tests/cli/test_readme.py runs the block: one OpenMP thread, a free API port
    env = child_env(s, state_dir=str(tmp_path)) | {"OMP_NUM_THREADS": "1"}
    kids = Children(env, log_dir=str(tmp_path / "logs"))
    board = open_board(s.bus, s.lifetimes)
    model = str(tmp_path / "model.gguf")
    try:
        for cmd in readme_commands():
            cmd = [model if w == "model.gguf" else w for w in cmd]
            cmd = [f"small={model}" if w == "small=model.gguf" else w for w in cmd]
            if cmd[0] == "model":
                subprocess.run([sys.executable, "-m", "kvq", *cmd], env=env, check=True)
                continue
            if cmd[0] == "api":
                cmd[cmd.index("--port") + 1] = str(free_port())
            kids.spawn(cmd[0], *cmd)
            if cmd[0] == "monitor":  # the block waits on `kvq health monitor`
                kids.wait_for(lambda: "small" in board.models(), 120, "the registration")
        kids.wait_for(lambda: board.coordinator_alive("coord-1"), 180, "the coordinator")
        slices = len(board.model_info("small").slices)
        kids.wait_for(
            lambda: (
                sum(v.worker_id == "laptop-1" and v.ready for v in board.workers("small")) == slices
            ),
            300,
            "laptop-1 to hold every slice",
        )
        yield {"r": r, "env": env, "kids": kids, "url": redis_server.url}
    finally:
        kids.stop_all(20)
        board.r.close()
        r.close()


@pytest.mark.slow
@pytest.mark.standalone
@pytest.mark.serial  # the worker's share of a burst needs the CPUs the README leaves it
@pytest.mark.timeout(900)
def test_the_readme_deployment_returns_what_the_page_says(
    readme_deployment: dict[str, Any],
) -> None:
    r, env = readme_deployment["r"], readme_deployment["env"]
    raw = raw_client(r)
    got = subprocess.run(
        [sys.executable, "-m", "kvq", "submit", "--model", "small", "--prompt", "hello", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr
    rid = json.loads(got.stdout)["request_id"]
    keys = Keys("kvq")
    # at rest: the reply's done is written, the coordinator's next slot poll has gone out
    wait_for(lambda: r.hlen(keys.model_routed("small")), 60, "routed rows", poll_s=0.2)
    claims = doc_claims()
    rest = {c.line: not is_empty(reply_of(r, raw, c.line, rid)) for c in claims}
    threads, ids, errors = _burst(readme_deployment["url"], BURST, 32)
    load = dict.fromkeys(rest, False)
    passes = 0
    while any(t.is_alive() for t in threads):
        for c in claims:
            load[c.line] = load[c.line] or not is_empty(reply_of(r, raw, c.line, ids[0]))
        passes += 1
        next((t for t in threads if t.is_alive()), threads[0]).join(0.05)  # 50 ms apart
    assert not errors, errors[0]
    wrong = [
        f"{c.line}: the page says at rest {c.rest}, under load {c.load}; got at rest "
        f"{'data' if rest[c.line] else 'empty'}, under load {'data' if load[c.line] else 'empty'}"
        for c in claims
        if (c.rest == "data") != rest[c.line]
        or (c.load != "sometimes" and (c.load == "data") != load[c.line])
    ]
    counts = (sum(rest.values()), sum(load.values()), len(claims))
    print(
        f"README deployment: data at rest {counts[0]}/{counts[2]}, under load "
        f"{counts[1]}/{counts[2]} ({passes} passes over the lines during the burst)"
    )
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def deployment(
    redis_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    if getattr(redis_server, "cluster", False) or "cluster" in type(redis_server).__name__.lower():
        pytest.skip("the README deploys one standalone server")
    tmp = tmp_path_factory.mktemp("streams-doc")
    model = tmp / "model.gguf"
    make_tiny(model, layers=2, experts=8, seed=4)
    r = redis.Redis.from_url(redis_server.url)
    for k in r.scan_iter("kvq:*"):  # the README's prefix: this module's keys only
        r.delete(k)
    for k in r.scan_iter("rq:*"):
        r.delete(k)
    s = Settings(redis_url=redis_server.url)
    # the README's ids and defaults, but for two settings that make traffic every section
    # describes: every expert job goes to the worker (results streams), and the worker takes
    # slices through the monitor's market (asks, answers)
    env = child_env(
        s,
        heartbeat_ttl_s=3.0,
        worker_market="monitor",
        state_dir=str(tmp),
        coordinator_experts="none",
    )
    kvq = [sys.executable, "-m", "kvq"]
    procs = []
    for cmd in (
        ["monitor", "--model", f"small={model}"],
        ["coordinator", "--model", str(model), "--model-id", "small", "--id", "coord-1"],
        ["worker", "--id", "laptop-1"],
    ):
        log = (tmp / f"{cmd[0]}.log").open("wb")
        procs.append(subprocess.Popen([*kvq, *cmd], env=env, stdout=log, stderr=log))
        log.close()
    board = open_board(s.bus, s.lifetimes)
    try:
        try:
            wait_for(
                lambda: (
                    any(c.alive for c in board.coordinators("small"))  # and laptop-1 holds all
                    and len({v.slice_id for v in board.workers("small") if v.alive and v.ready})
                    == 4
                ),
                120,
                "the coordinator, and every slice served",
                poll_s=0.2,
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n{(tmp / 'coordinator.log').read_text()[-3000:]}"
            ) from None
        got = subprocess.run(
            [
                *kvq,
                "submit",
                "--model",
                "small",
                "--prompt",
                "hello",
                "--max-tokens",
                "8",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr
        rid = json.loads(got.stdout)["request_id"]
        keys = Keys("kvq")
        # the routed counters go out on the coordinator's next slot poll, after the reply
        wait_for(lambda: r.hlen(keys.model_routed("small")), 120, "routed rows", poll_s=0.2)
        # what a deployment at rest has not got yet: a cancel, a dead letter, a verdict
        client.cancel(r, keys, "small", rid)  # its own key and the model's stream
        dead_letter(r, keys, keys.model_requests("small"), b"1-1", {b"x": b"1"}, "a test", 1000)
        until = int(time.time() * 1000) + 60_000
        # a worker the monitor reaped, as its reap records one
        board.record_departure(
            "laptop-2", Departure(ts_ms=int(board.now_ms()), why="lost: test", held="small: 1")
        )
        board.quarantine(
            "small",
            "laptop-1",
            Quarantine(until_ms=until, mismatches=1, coord="coord-1", reason="test"),
        )
        yield {"r": r, "rid": rid}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        board.r.close()
        r.close()


def has_data(reply: Any) -> bool:
    return reply is not None and reply != [] and reply != {} and reply != b""


@pytest.mark.slow
def test_every_redis_cli_line_returns_data(deployment: dict[str, Any]) -> None:
    r, rid = deployment["r"], deployment["rid"]
    raw = raw_client(r)
    ran, empty = 0, []
    for line in doc_lines():
        if not runnable(line):
            continue
        reply = reply_of(r, raw, line, rid)
        ran += 1
        if not has_data(reply) or str(reply).startswith("error:"):
            empty.append(f"{line}  -> {reply!r}")
    print(f"{ran} redis-cli lines of docs/streams.md run, {len(empty)} without data")
    assert not empty, "\n".join(empty)
    assert ran == len(doc_lines()) - len(ELSEWHERE)
