"""`kvq swarm-sim` (H9), the topology format, and `kvq bench swarm` on small sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvq.cli import main
from kvq.errors import TopologyError
from kvq.swarm import SimOptions, parse_nodes, parse_topology, simulate
from kvq.tools.bench.swarm import run_sim, run_swarm_bench

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "swarm.json"
GROW = ROOT / "examples" / "grow.json"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_the_documented_command_runs_as_written() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvq",
        "swarm-sim",
        "--topology",
        "examples/swarm.json",
        "--kill",
        "gpu",
        "--pipelines",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [s["step"] for s in doc["steps"]] == ["start", "failover"]
    start, fail = doc["steps"]
    assert start["status"] == "healthy" and start["route"]["nodes"] == ["gpu"]
    assert fail["status"] == "degraded" and fail["node"] == "gpu"
    assert fail["degraded"] is False and fail["replaced"] == [] and fail["rung"] == "copy"
    assert "gpu" not in fail["route"]["nodes"]
    assert {"pipeline_id", "nodes", "cost"} <= set(fail["route"])
    assert doc["final_plan_valid"] is True


def test_the_example_holds_two_models_never_mixed(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capsys, "swarm-sim", "--topology", str(EXAMPLE), "--kill", "gpu")
    assert code == 0
    for step in doc["steps"]:
        assert set(step["routes"]) == {"base", "base-code"}
        for model, route in step["routes"].items():
            assert route["model"] == model


def test_growth_and_removal_steps(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(
        capsys,
        "swarm-sim",
        "--topology",
        str(EXAMPLE),
        "--kill",
        "gpu",
        "--grow",
        str(GROW),
        "--remove",
        "laptop",
        "--seed",
        "3",
    )
    assert code == 0
    assert [s["step"] for s in doc["steps"]] == ["start", "failover", "growth", "growth", "removal"]
    grow = doc["steps"][2]
    assert grow["node"] == "edge-1" and grow["replan"]["added"]
    assert all("laptop" not in p["nodes"] for p in doc["final_plan"])
    assert all("gpu" not in p["nodes"] for p in doc["final_plan"])
    assert doc["final_plan_valid"] is True and doc["final_status"] == "healthy"


def test_the_same_seed_gives_the_same_document(capsys: pytest.CaptureFixture[str]) -> None:
    args = (
        "swarm-sim",
        "--topology",
        str(EXAMPLE),
        "--kill",
        "gpu",
        "--kill",
        "desktop",
        "--seed",
        "7",
    )
    assert _run(capsys, *args)[1] == _run(capsys, *args)[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kill", "nope"), "UnknownNode: unknown node 'nope'"),
        (("--remove", "nope"), "UnknownNode"),
        (("--model", "nope"), "UnknownModel: unknown model 'nope'"),
    ],
)
def test_unknown_names_exit_2_with_a_clear_error(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, doc, err = _run(capsys, "swarm-sim", "--topology", str(EXAMPLE), *args)
    assert (code, doc) == (2, None)
    assert message in err


def test_bad_topology_files_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cases = {
        "missing.json": None,
        "bad.json": "{not json",
        "typo.json": json.dumps({"nodes": [{"id": "a", "memory_gb": 4}], "models": []}),
        "small.json": json.dumps(
            {
                "nodes": [{"id": "a", "memory_gib": 1}],
                "models": [{"id": "m", "layers": 4, "layer_gib": 1}],
            }
        ),
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        code, _, err = _run(capsys, "swarm-sim", "--topology", str(tmp_path / name))
        assert code == 2 and err.startswith("kvq swarm-sim: "), (name, err)


def test_unrecoverable_failover_is_a_step_not_a_crash() -> None:
    topo = parse_topology(json.loads(EXAMPLE.read_text()))
    doc = simulate(topo, SimOptions(kills=("gpu", "desktop", "mini"), pipelines=2))
    gpu, desktop, mini = doc["steps"][1:]
    assert gpu["rung"] == "copy"
    assert desktop["route"] is None and "no fallback model" in desktop["error"]
    assert desktop["status"] == "degraded"  # survivors remain: not failed
    assert mini["route"] is None and mini["error"].startswith("NoRoute")  # nothing left to lose
    assert desktop["routes"]["base-code"]["model"] == "base-code"  # H10: the other model serves


def test_topology_parser_names_the_bad_field() -> None:
    base = {
        "nodes": [{"id": "a", "memory_gib": 4}],
        "models": [{"id": "m", "layers": 1, "layer_gib": 1}],
    }
    assert parse_topology(base).pipelines is None
    bad = [
        ({**base, "extra": 1}, "unknown fields"),
        ({**base, "nodes": [{"id": "a", "memory_gib": "4"}]}, "memory_gib must be a number"),
        ({**base, "nodes": [{"id": "a", "memory_gib": 4}] * 2}, "duplicate node ids"),
        ({**base, "models": [{"id": "m", "layers": 1.5, "layer_gib": 1}]}, "layers must be an int"),
        ({**base, "models": [{**base["models"][0], "fallback": "z"}]}, "fallback 'z'"),
        ({"nodes": []}, "'nodes' must be a non-empty list"),
    ]
    for data, match in bad:
        with pytest.raises(TopologyError, match=match):
            parse_topology(data)
    assert [n.node_id for n in parse_nodes([{"id": "z", "memory_gib": 1}])] == ["z"]


def test_bench_figures_on_a_small_swarm(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_swarm_bench(nodes=60, models=4, routes=2000, steps=600, seed=1)
    assert r["routes_per_s"] > 0 and r["sim_seconds"] > 0 and r["copies"] >= 4
    assert run_sim(60, 600, 1)[1:] == run_sim(60, 600, 1)[1:]  # deterministic
    code = main(["bench", "swarm", "--json", "--nodes", "40", "--routes", "500", "--steps", "200"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and {"routes_per_s", "sim_seconds"} <= set(doc)
