"""`kvq bench api`: one small real run through the CLI (every role a process)."""

from __future__ import annotations

import json

import pytest

from kvq.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_bench_api_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "api",
        "--json",
        "--streams",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "4",
        "--rounds",
        "1",
    ]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    for side in ("direct", "api"):
        r = got[side]
        assert (
            r["tokens"] > 0 and r["tokens_per_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        )
    assert got["api"]["tokens"] == got["direct"]["tokens"], "the same greedy requests"
    assert got["ratio"] == pytest.approx(
        got["api"]["tokens_per_s"] / got["direct"]["tokens_per_s"], abs=1e-3
    )
    assert got["streams"] == 2 and len(got["api_rounds"]) == 1
