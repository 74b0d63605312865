"""Coarse background jobs on RQ (issue 12 item 13), against the tests' real server: a `kvq
monitor --model` process registers through an RQ job that `rq info` shows with the monitor's
worker; histogram collection and hot-set planning run as RQ jobs and give what the direct calls
give; job data is JSON, never pickle; KVQ_RQ_URL is validated and a cluster node is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env, load_settings
from kvq.errors import ConfigError
from kvq.local.procs import Children
from kvq.monitor import coarse
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("coarse") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=5)
    return path


@pytest.mark.standalone  # RQ needs a standalone server (KVQ_RQ_URL)
def test_the_monitor_registers_through_rq_and_rq_info_shows_it(
    settings: Settings, model: Path, tmp_path: Path
) -> None:
    board = open_board(settings.bus, settings.lifetimes)
    kids = Children(child_env(settings), log_dir=str(tmp_path))
    try:
        kids.spawn("monitor", "monitor", "--model", f"tiny={model}", "--id", "mon-rq")
        kids.wait_for(lambda: "tiny" in board.models(), 60, "the registration job")
        info = board.model_info("tiny")
        assert info is not None and info.slices and all(s.sha256 for s in info.slices.values())
        name = coarse.queue_name(settings.prefix)
        queue = Queue(name, connection=board.r, serializer=JSONSerializer)
        (job_id,) = queue.finished_job_registry.get_job_ids()
        job = queue.fetch_job(job_id)
        assert job is not None and job.func_name.endswith("coarse.register_model")
        assert job.return_value() == {"model": "tiny", "slices": len(info.slices)}
        data = board.r.hget(f"rq:job:{job_id}", "data")
        assert json.loads(zlib.decompress(data))[0].endswith("register_model"), "JSON, no pickle"
        rq = Path(sys.executable).parent / "rq"
        shown = subprocess.run(
            [str(rq), "info", "--url", settings.redis_url],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert name in shown and "mon-rq" in shown, shown
    finally:
        kids.stop_all()
        board.r.close()


@pytest.mark.standalone  # RQ needs a standalone server (KVQ_RQ_URL)
def test_histogram_and_plan_run_as_rq_jobs(settings: Settings, model: Path, tmp_path: Path) -> None:
    from kvq.bank.collect import collect_histogram
    from kvq.bank.hot_set import plan_hot_set

    board = open_board(settings.bus, settings.lifetimes)
    jobs = coarse.CoarseJobs(settings.redis_url, settings.prefix, "test-coarse")
    jobs.serve(board)
    try:
        out = tmp_path / "hist.json"
        got = jobs.wait(
            jobs.enqueue(
                coarse.collect_histogram, str(model), ["a b", "c d e"], 4, str(out), "cpu"
            ),
            120,
        )
        direct = collect_histogram(model, ["a b", "c d e"], 4)
        assert got["routed"] == sum(int(t.counts.sum()) for t in direct.layers) > 0
        plan: dict[str, Any] = jobs.wait(jobs.enqueue(coarse.plan_hot_set, str(out), 200_000), 60)
        assert plan == json.loads(json.dumps(plan_hot_set(direct.layers, 200_000).to_json()))
        with pytest.raises(Exception, match="failed"):
            jobs.wait(jobs.enqueue(coarse.plan_hot_set, str(tmp_path / "missing.json"), 1), 60)
    finally:
        jobs.close()
        board.r.close()


def test_rq_url_is_validated_and_a_cluster_node_refused() -> None:
    with pytest.raises(ConfigError, match="KVQ_RQ_URL"):
        load_settings(rq_url="localhost:6379")
    assert load_settings(rq_url="").coarse_url == load_settings().redis_url

    class ClusterNode:
        def info(self, section: str) -> dict[str, int]:
            return {"cluster_enabled": 1}

    with pytest.raises(ConfigError, match="not cluster-safe"):
        coarse._refuse_cluster(ClusterNode())  # type: ignore[arg-type]
