"""`kvq bench elastic` end to end with tiny durations (real processes): the JSON keys it
reports and sane values; bad options refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.elastic import ElasticBench, run_elastic_bench
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow  # a system of kvq roles or processes

KEYS = {
    "saturation_to_first_remote_s",
    "drain_to_release_s",
    "boost_flips_per_10min",
    "remote_share_saturated",
    "boost_flips",
    "noisy_window_s",
    "idle_release_s",
    "saturation_leave_s",
    "saturation_enter_s",
    "monitor_poll_s",
    "targets",
    "policy",
}


def test_elastic_bench_reports_its_timings(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=2, experts=8, experts_used=2)
    r = run_elastic_bench(
        ElasticBench(
            model=str(model),
            max_tokens=4,
            saturated_s=2.0,
            noisy_s=2.0,
            idle_release_s=0.5,
            saturation_enter_s=0.2,
            saturation_leave_s=0.5,
            monitor_poll_s=0.1,
            log_dir=str(tmp_path / "logs"),
        )
    )
    assert KEYS <= r.keys()
    assert 0 < r["saturation_to_first_remote_s"] < 60
    assert 0 <= r["drain_to_release_s"] < 60
    assert r["idle_release_s"] == 0.5 and r["saturation_leave_s"] == 0.5
    assert 0.0 <= r["remote_share_saturated"] <= 1.0
    assert r["boost_flips"] >= 0 and r["noisy_window_s"] >= 2.0
    assert r["boost_flips_per_10min"] == pytest.approx(
        r["boost_flips"] * 600 / r["noisy_window_s"], rel=0.05
    )


@pytest.mark.parametrize(
    "bad", [{"sequences": 2}, {"saturated_s": 0.0}, {"noisy_s": -1.0}, {"dispatch_policy": "x"}]
)
def test_bad_options_are_refused_first(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ElasticBench(**bad).check()
