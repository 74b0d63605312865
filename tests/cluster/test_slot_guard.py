"""The cluster run's pipeline guard (`tests/slot_guard.py`) catches what it claims to: a kvq
pipeline over several slots, unless its builder is classified order-free."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvq.bus import connect
from kvq.config import load_settings
from kvq.local.cluster import EmbeddedCluster

sys.path.insert(0, str(Path(__file__).parents[1]))
from slot_guard import command_keys, guard_pipelines

BUILD = """
def write_pair(r, a, b):
    pipe = r.pipeline(transaction=False)
    pipe.xadd(a, {"k": "v"})
    pipe.xadd(b, {"k": "v"})
    pipe.execute()
"""


def kvq_function(module: str) -> object:
    """`write_pair` as if defined in kvq module `module`."""
    scope: dict[str, object] = {"__name__": module}
    exec(BUILD, scope)  # a fixed source, to give the frame a kvq module name
    return scope["write_pair"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[redis.RedisCluster]:
    with EmbeddedCluster(masters=3) as c:
        client = connect(load_settings(redis_url=c.url).bus)
        assert isinstance(client, redis.RedisCluster)
        yield client
        client.close()
    # a pipeline over two slots leaves a node connection that redis-py does not close; it is
    # finalized here rather than in whichever later test collects garbage first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_a_kvq_pipeline_over_two_slots_is_caught(cluster: redis.RedisCluster) -> None:
    write = kvq_function("kvq.somewhere")
    with guard_pipelines() as offences:
        write(cluster, "p:{a}:x", "p:{b}:x")  # type: ignore[operator]
    assert len(offences) == 1 and offences[0].startswith("kvq.somewhere:write_pair: 2 slots")


def test_one_slot_and_order_free_builders_pass(cluster: redis.RedisCluster) -> None:
    with guard_pipelines() as offences:
        kvq_function("kvq.somewhere")(cluster, "p:{a}:x", "p:{a}:y")  # type: ignore[operator]
        send_jobs = kvq_function("kvq.bus.redis_board")
        send_jobs.__code__ = send_jobs.__code__.replace(co_name="send_jobs")  # type: ignore[attr-defined]
        send_jobs(cluster, "p:{a}:x", "p:{b}:x")  # type: ignore[operator]
    assert offences == []


def test_command_keys_reads_stream_reads_and_scripts() -> None:
    assert command_keys(("XADD", "k", "*", "f", "v")) == [b"k"]
    assert command_keys(
        ("XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "STREAMS", "a", "b", ">", ">")
    ) == [b"a", b"b"]
    assert command_keys((b"XREAD", b"STREAMS", b"a", b"0")) == [b"a"]
    assert command_keys(("EVALSHA", "sha", 2, "k1", "k2", "arg")) == [b"k1", b"k2"]
    assert command_keys(("PING",)) == []
