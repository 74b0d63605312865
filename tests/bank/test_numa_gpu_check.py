"""KVQ_NUMA_POLICY on a fake sysfs, and the GPU check (workers/) without CUDA."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvq.bank import BankOptions, numa
from kvq.errors import BankError

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "workers/gpu_check.py"


def fake_sysfs(tmp_path: Path, cpulists: list[str]) -> Path:
    for i, cpus in enumerate(cpulists):
        d = tmp_path / f"devices/system/node/node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return tmp_path


def test_parse_cpulist() -> None:
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("") == set()


def test_off_and_single_node(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert "off" in numa.apply_numa_policy("off", cpu, tmp_path)
    one = fake_sysfs(tmp_path, ["0-3"])
    assert "one NUMA node, nothing to do" in numa.apply_numa_policy("bind", cpu, one)
    with pytest.raises(BankError, match="numa_policy"):
        BankOptions(numa_policy="interleave")  # checked once, where the options are built


def test_two_nodes_preferred_and_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sysfs = fake_sysfs(tmp_path, ["0-1", "2-3"])
    monkeypatch.setattr("kvq.bank.numa.os.sched_getaffinity", lambda pid: {2, 3})
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        "kvq.bank.numa.os.sched_setaffinity", lambda pid, cpus: calls.append(("cpus", cpus))
    )

    class FakeNuma:
        def numa_set_preferred(self, node: Any) -> None:
            calls.append(("preferred", node.value))

        def numa_parse_nodestring(self, s: bytes) -> bytes:
            return s

        def numa_set_membind(self, mask: bytes) -> None:
            calls.append(("membind", mask))

    monkeypatch.setattr(numa, "_libnuma", FakeNuma)
    cpu = torch.device("cpu")
    assert "prefer node 1" in numa.apply_numa_policy("preferred", cpu, sysfs)
    assert "bound to node 1" in numa.apply_numa_policy("bind", cpu, sysfs)
    assert calls == [("preferred", 1), ("cpus", {2, 3}), ("membind", b"1")]
    monkeypatch.setattr(numa, "_libnuma", lambda: None)
    assert "not applied (no libnuma)" in numa.apply_numa_policy("preferred", cpu, sysfs)
    assert "first touch" in numa.apply_numa_policy("bind", cpu, sysfs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check_main = runpy.run_path(str(GPU_CHECK))["main"]  # a script, not a kvq module
    assert gpu_check_main([]) == 0
    assert "no CUDA device visible" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_script_without_cuda() -> None:
    env = {**os.environ, "PYTHON": sys.executable}  # the interpreter running the tests
    proc = subprocess.run(
        ["bash", str(ROOT / "workers/gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "nothing to check" in proc.stdout
