"""`kvq balance collect|rerank|plan` and `kvq bench bank` (B3, figures of issue 4)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvq.bank import load_hist
from kvq.cli import main
from kvq.gguf import read_meta, slice_nbytes
from kvq.tools.bench.bank import TraceSpec, run_trace
from kvq.tools.synth import make_tiny


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bank") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, hidden=32, expert_ffn=32)
    return path


def test_collect_counts_every_routing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n\nexperts\n")
    out = tmp_path / "h.json"
    assert (
        main(
            [
                "balance",
                "collect",
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                "--tokens",
                "4",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    hist = load_hist(out)
    meta = read_meta(model)
    # (BOS + bytes + generated tokens, minus the last one never fed back) x experts_used
    tokens = (1 + 5 + 4 - 1) + (1 + 7 + 4 - 1)
    for t in hist.layers:
        assert int(t.counts.sum()) == tokens * 2
        assert t.expert_bytes.tolist() == [slice_nbytes(meta, t.layer, 0, 1)] * 8
    assert "2 layers" in capsys.readouterr().out


def test_collect_errors(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    assert (
        main(
            [
                "balance",
                "collect",
                "--model",
                str(model),
                "--prompts",
                str(empty),
                "-o",
                str(tmp_path / "h.json"),
            ]
        )
        == 1
    )
    assert "no non-empty line" in capsys.readouterr().err


def _write(path: Path, counts: list[list[int]], model: str = "m") -> Path:
    layers = [
        {"layer": i, "counts": c, "expert_bytes": [1 << 20] * len(c)} for i, c in enumerate(counts)
    ]
    path.write_text(json.dumps({"model": model, "layers": layers}))
    return path


def test_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h = _write(tmp_path / "h.json", [[5, 1, 9, 0], [2, 8, 1, 1]])
    assert main(["balance", "plan", "--hist", str(h), "--budget-gib", str(3 / 1024), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hot"] == {"0": [0, 2], "1": [1]}
    assert doc["bytes_used"] == 3 << 20 and doc["covered_share"] == pytest.approx(22 / 27)


def test_plan_human(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h = _write(tmp_path / "h.json", [[5, 1, 9, 0]])
    assert main(["balance", "plan", "--hist", str(h), "--budget-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer   0:    4 hot  0 1 2 3" in out and "covered share 1.0000" in out


def test_plan_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"model": "m", "layers": [{"layer": 0, "counts": [1, -3], "expert_bytes": [1, 1]}]}
        )
    )
    assert main(["balance", "plan", "--hist", str(bad), "--budget-gib", "1"]) == 1
    assert "layer 0 expert 1" in capsys.readouterr().err
    good = _write(tmp_path / "h.json", [[1]])
    assert main(["balance", "plan", "--hist", str(good), "--budget-gib", "-1"]) == 2


def test_rerank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = _write(tmp_path / "ref.json", [[100, 50, 1, 0]])
    live = _write(tmp_path / "live.json", [[0, 0, 500, 400]])
    out = tmp_path / "out.json"
    assert main(["balance", "rerank", str(ref), "--traffic", str(live), "-o", str(out)]) == 0
    counts = load_hist(out).layers[0].counts.tolist()
    assert counts[2] > counts[3] > counts[0] > counts[1]
    other = _write(tmp_path / "o.json", [[1, 1, 1, 1]], model="x")
    assert main(["balance", "rerank", str(ref), "--traffic", str(other), "-o", str(out)]) == 1


def test_trace_meets_the_targets() -> None:
    r = run_trace(TraceSpec(layers=2, updates_before=4, updates_after=4))
    assert r["dynamic_after"] >= r["static_after"] + 0.10
    assert r["dynamic_before"] >= r["static_before"] - 0.01
    assert r["pingpong_swaps"] == 0


def test_bench_bank_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "bank", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("static_before", "dynamic_before", "static_after", "dynamic_after"):
        assert 0.0 <= r[key] <= 1.0
    assert r["dynamic_after"] >= r["static_after"] + 0.10
    assert r["dynamic_before"] >= r["static_before"] - 0.01
    assert r["pingpong_swaps"] == 0
    assert 0 < r["planner_ms_61x256"] < 50
    assert r["greedy_gap_mixed"] >= 0
