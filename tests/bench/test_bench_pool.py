"""`kvq bench pool`'s parts that need no root: options, the skip line, the cgroup lookup, the
figures of a window and the report's shape (the bench itself runs as root: docs/routing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvq.bus.histogram import Histogram
from kvq.bus.records import CoordStats
from kvq.cli import build_parser, main
from kvq.errors import ConfigError
from kvq.tools.bench import pool, pool_report, pool_sandbox
from kvq.tools.bench.delay_proxy import DelayProxy
from kvq.tools.bench.pool import PoolBench, run_pool_bench


@pytest.mark.parametrize(
    "bad",
    [
        {"workers": 0},
        {"cap_fraction": 0.0},
        {"workers": 1},
        {"rtts_ms": (-1.0,)},
        {"sequences": ()},
        {"sequences": (0,)},
        {"measure_s": 0.0},
        {"copies": 0},
    ],
)
def test_bad_options_are_refused_before_anything_starts(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        PoolBench(**bad).check()


def test_one_worker_runs_without_the_kill_phase() -> None:
    PoolBench(workers=1, cap_fraction=1.1, kill=False).check()


def test_the_skip_line_names_what_is_missing() -> None:
    assert "needs root" in (pool_sandbox.skip_reason(euid=1000) or "")
    assert "no memory cgroup" in (pool_sandbox.skip_reason(euid=0, cgroup_dir=None) or "")
    assert pool_sandbox.skip_reason(euid=0, cgroup_dir=Path("/x")) is None


def test_without_root_the_bench_reports_its_skip_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = "kvq bench pool: skipped: needs root (memory cgroups and network namespaces)"
    monkeypatch.setattr(pool_sandbox, "skip_reason", lambda: line)
    assert run_pool_bench(PoolBench()) == {"skipped": line}
    assert main(["bench", "pool"]) == 0
    assert capsys.readouterr().out.strip() == line


def test_the_memory_cgroup_is_found_in_v1_and_v2_trees(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    (v1 / "memory" / "a" / "b").mkdir(parents=True)
    (v1 / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text("1\n")
    text = "4:memory:/a/b\n0::/\n"
    assert pool_sandbox.memory_cgroup_dir(v1, text) == v1 / "memory" / "a" / "b"
    v2 = tmp_path / "v2"
    (v2 / "user").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    assert pool_sandbox.memory_cgroup_dir(v2, "0::/user\n") == v2 / "user"
    (v2 / "cgroup.controllers").write_text("cpu pids\n")
    assert pool_sandbox.memory_cgroup_dir(v2, "0::/user\n") is None


def test_the_cli_parses_the_lists() -> None:
    a = build_parser().parse_args(
        [
            "bench",
            "pool",
            "--rtt-ms",
            "0,20",
            "--sequences",
            "1,8",
            "--workers",
            "2",
            "--cap-fraction",
            "0.6",
            "--no-netns",
        ]
    )
    assert a.rtt_ms == (0.0, 20.0) and a.sequences == (1, 8) and a.workers == 2
    assert a.cap_fraction == 0.6 and a.no_netns and not a.no_kill and a.copies == 2


def _stats(n: int) -> CoordStats:
    h = Histogram()
    for _ in range(n):
        h.observe(0.004)
    return CoordStats(
        remote_jobs=10 * n,
        remote_sent=10 * n,
        remote_wait_s=0.5 * n,
        remote_send_s=0.01 * n,
        job_rtt_s=h.to_text(),
    )


def test_a_window_reports_per_layer_and_per_token_figures() -> None:
    w = pool_report.window(
        _stats(1),
        _stats(3),
        10.0,
        40,
        {"coordinator": 1.0, "workers": 2.0},
        {"coordinator": 3.0, "workers": 6.0},
        8,
    )
    assert w["tok_s"] == 4.0 and w["remote_share"] == 1.0 and w["remote_jobs"] == 20
    assert w["wait_ms_per_layer_token"] == pytest.approx(1000 * 1.0 / (40 * 8))
    assert w["jobs_per_layer_token"] == pytest.approx(20 / (40 * 8), abs=1e-3)
    assert w["job_rtt_mean_ms"] == 4.0
    assert w["coord_cpu_ms_per_token"] == 50.0 and w["workers_cpu_ms_per_token"] == 100.0


def _report(tmp_path: Path) -> dict[str, Any]:
    full, bb = tmp_path / "m.gguf", tmp_path / "m-backbone.gguf"
    full.write_bytes(b"x" * 100)
    bb.write_bytes(b"x" * 10)
    run = pool_report.window(
        None, None, 1.0, 0, {"coordinator": 0, "workers": 0}, {"coordinator": 0, "workers": 0}, 8
    )
    held = {"w0": {"held_bytes": 2**20}}
    runs = [run | {"rtt_ms": 0.0, "sequences": 1, "failed_requests": 0, "workers": held}]
    kill = {
        "victim": "w0",
        "victim_slices": 3,
        "victim_only_copies": 0,
        "rtt_ms": 0.0,
        "sequences": 8,
        "recover_s": 0.0,
        "recover_timeout_s": 60,
        "uncovered_after": 0,
        "heartbeat_ttl_s": 3,
        "failed_requests": 0,
        "completed_requests": 5,
        "longest_token_gap_s": 2.1,
    }
    shape = {"layers": 8}
    return pool_report.build(PoolBench(), full, bb, 90, 64, shape, True, runs, kill, (0, 1))


def test_the_report_has_its_documented_keys_and_prints(tmp_path: Path) -> None:
    r = _report(tmp_path)
    assert tuple(r) == pool_report.REPORT_KEYS
    assert r["no_worker_holds_model"] and r["survivors_hold_model"]
    text = "\n".join(pool_report.lines(r))
    assert "SIGKILL of w0" in text and "OMP_NUM_THREADS=1" in text
    assert pool_report.lines({"skipped": "a line"}) == ["a line"]


def test_the_proxy_listens_where_it_is_told() -> None:
    with DelayProxy("127.0.0.1", 9, 0.0) as p:
        assert p.listen_host == "127.0.0.1" and p.port > 0
    assert pool.MODEL_ID == "pool"
