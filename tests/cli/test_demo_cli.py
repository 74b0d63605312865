"""`kvq demo`, `kvq submit` and `kvq bench bus` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.config import Settings, child_env
from kvq.coordinator import Coordinator
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.monitor import Monitor
from kvq.text import ByteTokenizer

pytestmark = pytest.mark.slow
KVQ = [sys.executable, "-m", "kvq"]


def _marked_env() -> tuple[dict[str, str], bytes]:
    """An environment whose marker every descendant process inherits."""
    mark = f"KVQTEST_MARK={uuid.uuid4().hex}"
    name, value = mark.split("=")
    return {**os.environ, name: value}, mark.encode()


def _pids_with(mark: bytes) -> set[int]:
    """Live processes (not zombies) whose environment carries `mark`."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                if " Z " not in (proc / "stat").read_text().split(")", 1)[1][:4]:
                    pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def test_demo_json_twice_in_a_row() -> None:
    env, mark = _marked_env()
    for _ in range(2):
        out = subprocess.run(
            [*KVQ, "demo", "--json"], capture_output=True, text=True, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        for key in (
            "requests_completed",
            "tokens_generated",
            "local_jobs",
            "remote_jobs",
            "fallback_jobs",
            "workers_recruited",
            "remote_matches_local",
            "redis",
            "wall_s",
        ):
            assert key in summary
        assert summary["requests_completed"] == 16
        assert summary["remote_jobs"] > 0 and summary["local_jobs"] > 0
        assert summary["remote_matches_local"] is True
        assert summary["workers_recruited"] == 2
        assert summary["saturated_during_burst"] is True
        assert summary["redis"] == "embedded"
        hot, cold = summary["hot_hit_rate"], summary["cold_hit_rate"]
        assert 0 < hot < 1 and abs(hot + cold - 1) < 1e-3, "a quarter-size hot bank: both hit"
        assert summary["wall_s"] < 60
    wait_for(
        lambda: not _pids_with(mark), 0.5, "the demo to leave no processes behind: none after 0.5 s"
    )


def test_demo_ctrl_c_stops_everything(tmp_path: Path) -> None:
    env, mark = _marked_env()
    proc = subprocess.Popen(
        [*KVQ, "demo", "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "volunteered" in line:
            break
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) != 0
    proc.stdout.close()
    wait_for(
        lambda: not _pids_with(mark), 0.5, "Ctrl-C to leave no processes behind: none after 0.5 s"
    )


def test_submit_streams_the_completion(settings: Settings, tmp_path: Path, run_in_thread) -> None:
    from kvq.tools.synth import make_tiny

    model = tmp_path / "m.gguf"
    make_tiny(model)
    Monitor.from_settings(settings).register("m", model)
    run_in_thread(Coordinator.from_settings(settings, "c1", "m", model))
    out = subprocess.run(
        [*KVQ, "submit", "--model", "m", "--prompt", "hi there", "--max-tokens", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(settings),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    bb = Backbone.from_gguf(model)
    assert got["token_ids"] == generate(bb, ByteTokenizer.from_meta(bb.meta).encode("hi there"), 5)


def test_bench_bus_json_shape(settings: Settings) -> None:
    out = subprocess.run(
        [*KVQ, "bench", "bus", "--json", "--jobs", "200", "--redis", settings.redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("kvq", "raw", "rq"):
        assert {"jobs_per_s", "p50_ms", "p99_ms"} <= set(res[name])
        assert res[name]["jobs_per_s"] > 0
    assert res["ratio_vs_raw_batched"] > 0 and res["ratio_vs_rq"] > 0


def test_demo_with_every_process_under_its_acl_user() -> None:
    """`kvq demo --acl`: monitor, coordinator, workers and the client each log in as their
    `kvq acl` user; the whole burst works with zero ACL denials."""
    out = subprocess.run(
        [*KVQ, "demo", "--acl", "--json", "--requests", "6", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["acl_denials"] == 0 and summary["requests_completed"] == 6
    assert summary["remote_jobs"] > 0 and summary["remote_matches_local"] is True


def test_demo_on_a_local_cluster_spreads_the_requests_over_its_masters() -> None:
    """Issue 14: `kvq demo --cluster 3` end to end, the requests over 6 shards on 3 masters."""
    env, _ = _marked_env()
    env["KVQ_REQUEST_SHARDS"] = "6"
    out = subprocess.run(
        [*KVQ, "demo", "--cluster", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["redis"] == "cluster of 3"
    assert summary["requests_completed"] == 16 and summary["remote_jobs"] > 0
    assert summary["remote_matches_local"] is True
    assert summary["request_shards"] == 6 and summary["request_nodes"] == 3
