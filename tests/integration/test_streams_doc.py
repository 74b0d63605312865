"""Every `redis-cli` line of docs/streams.md, run against the README's own deployment (issue 30,
item 7): model `small`, coordinator `coord-1`, worker `laptop-1`, prefix `kvq`, registered by
`kvq monitor` (an RQ job), as real processes on an embedded Redis. Each line is split as a
shell would (`shlex`) and sent with redis-py's `execute_command`; each must return data (not
nil, not an empty list or map).

The deployment sends every expert job to the worker (`KVQ_COORDINATOR_EXPERTS=none`) and has
the worker take slices through the monitor (`KVQ_WORKER_MARKET=monitor`), so that the results
and market streams exist. A deployment at rest has no dead letter, cancel, quarantine verdict or market exchange: the
test makes one of each the way the system does (a request cancelled, a dead letter written by
`kvq.bus.dead_letter`, a verdict by the board), then runs the lines. `REQUEST_ID` in a line is
the id `kvq submit --json` printed. Lines that need another server are named in `ELSEWHERE`
with the reason (TLS, a Cluster): they are checked to be there, not run."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from waiting import wait_for

from kvq import client
from kvq.bus.records import Departure, Quarantine
from kvq.bus.redis_board import open_board
from kvq.bus.streams import dead_letter
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.tools.synth import make_tiny

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "streams.md"
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
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Running it for real", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return set(re.findall(r"--id (\S+)", block)) | set(re.findall(r"--model (\w+)=", block))


def test_the_page_uses_the_readmes_ids() -> None:
    ids = readme_ids()
    assert {"small", "coord-1", "laptop-1"} <= ids, ids
    text = "\n".join(doc_lines())
    for stale in ("tiny", "worker-0", "worker-gpu-3"):
        assert stale not in text, f"docs/streams.md still says {stale!r}: the README deploys {ids}"


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
    raw = redis.Redis(connection_pool=r.connection_pool)
    raw.response_callbacks.clear()  # the server's replies as they are, as redis-cli prints them
    ran, empty = 0, []
    for line in doc_lines():
        if any(mark in line for mark in ELSEWHERE):
            continue
        args = shlex.split(line.replace("REQUEST_ID", rid))[1:]
        if args[:1] == ["--scan"]:  # redis-cli's own SCAN loop
            pattern = args[args.index("--pattern") + 1]
            reply: Any = list(r.scan_iter(pattern, count=1000))
        else:
            try:
                reply = raw.execute_command(*args)
            except redis.ResponseError as exc:  # a key the deployment never made, ...
                reply = f"error: {exc}"
        ran += 1
        if not has_data(reply) or str(reply).startswith("error:"):
            empty.append(f"{line}  -> {reply!r}")
    print(f"{ran} redis-cli lines of docs/streams.md run, {len(empty)} without data")
    assert not empty, "\n".join(empty)
    assert ran == len(doc_lines()) - len(ELSEWHERE)
