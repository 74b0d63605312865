"""Shared fixtures: a real Redis server started by the tests, and per-test key prefixes."""

from __future__ import annotations

import gc
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest
import redis
from boards import BoardCase, make_case

from kvq.bus import connect
from kvq.config import Settings, load_settings
from kvq.local.cluster import EmbeddedCluster
from kvq.local.server import EmbeddedRedis

# CLUSTER_TESTS=1: the same tests against a local 3-master Redis Cluster (issue 14); tests
# that need a single server (restarting it, raw multi-key commands) are marked `standalone`
ON_CLUSTER = os.environ.get("CLUSTER_TESTS") == "1"
ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--llama-cpp-src",
        default=str(ROOT / ".tools" / "llama.cpp"),
        help="llama.cpp's source tree, for its real vocabularies (models/ggml-vocab-*.gguf) in "
        "tests/model/test_model_pretokenizers.py; .ci/run unpacks them from llama-cpp-python's "
        "sdist into .tools/llama.cpp, the default",
    )


def pytest_configure(config: pytest.Config) -> None:
    if ON_CLUSTER:
        # a RedisCluster client that a test leaves to the collector warns about its node
        # sockets; the standalone run still treats every unclosed socket as an error
        config.addinivalue_line("filterwarnings", "ignore:unclosed <socket:ResourceWarning")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # a pytest-xdist worker: torch computes on its share of the CPUs
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ON_CLUSTER:
        skip = pytest.mark.skip(reason="needs a standalone server (CLUSTER_TESTS=1)")
        for item in items:
            if "standalone" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported and built (torch, transformers, every test module and item: most
    of the heap, none of it garbage) is frozen out of the cyclic collector's sight, so that the
    collection that ends each test using `settings` scans only what was made since (1 s a test
    on a loaded 2-CPU machine otherwise)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_multi_slot_pipelines() -> Iterator[None]:
    """On the cluster run: a test fails if kvq ran a pipeline over several slots whose order
    may matter (`tests/slot_guard.py`, issue 14 item 2)."""
    if not ON_CLUSTER:
        yield
        return
    from slot_guard import guard_pipelines

    with guard_pipelines() as offences:
        yield
    assert not offences, "multi-slot pipelines outside slot_guard.ORDER_FREE:\n" + "\n".join(
        sorted(set(offences))
    )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis | EmbeddedCluster]:
    """One private server (or cluster) on free ports for the whole session, stopped at the
    end."""
    with EmbeddedCluster(masters=3) if ON_CLUSTER else EmbeddedRedis() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def settings(redis_server: EmbeddedRedis | EmbeddedCluster, prefix: str) -> Iterator[Settings]:
    """Settings pointing at the test server, with a prefix no other test uses."""
    yield load_settings(
        redis_url=redis_server.url,
        prefix=prefix,
        block_ms=100,
        heartbeat_ttl_s=1.0,
        volunteer_poll_s=0.05,
        monitor_poll_s=0.1,
        dispatch_refresh_ms=50,
        slot_poll_s=0.02,
        saturation_enter_s=0.0,
        saturation_leave_s=0.0,  # tests of hysteresis set their own
    )
    # the Redis clients a test's components opened are closed by their finalizers now, while
    # the test runs, not at session end as unclosed sockets (warnings are errors); an event
    # loop a client library (litellm) left open is closed here without failing this test
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
def r(redis_server: EmbeddedRedis | EmbeddedCluster) -> Iterator[redis.Redis]:
    client = connect(load_settings(redis_url=redis_server.url).bus)
    yield client
    client.close()


class Runnable(Protocol):
    stop: threading.Event

    def run(self) -> None: ...


@pytest.fixture
def run_in_thread() -> Iterator[Callable[[Runnable], threading.Thread]]:
    """Start `obj.run()` on a thread; every one is stopped and joined after the test."""
    started: list[tuple[Runnable, threading.Thread]] = []

    def start(obj: Runnable) -> threading.Thread:
        t = threading.Thread(target=obj.run, daemon=True)
        t.start()
        started.append((obj, t))
        return t

    yield start
    for obj, _ in started:
        obj.stop.set()
    for obj, t in started:
        t.join(timeout=10)
        board = getattr(obj, "board", None)
        client = getattr(board, "r", None)
        if client is not None:  # close its sockets now, not whenever the collector gets there
            client.close()


@pytest.fixture(params=["memory", "redis"])
def board_case(request: pytest.FixtureRequest) -> BoardCase:
    """The same test on the in-memory board and on a Redis board (real server)."""
    return make_case(request, request.param)
