"""`kvq bench kernels` runs every fused type against dequantize + matmul and reports both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvq.quant import kernels
from kvq.tools.bench.kernels import KernelsBench, run_kernels_bench


@pytest.mark.slow
def test_every_kernel_type_is_timed_against_the_dense_path() -> None:
    r = run_kernels_bench(KernelsBench(rows=64, cols=256, batches=(1, 3), matrices=2, repeat=1))
    got = {(row["type"], row["rows"]) for row in r["results"]}
    assert got == {(t.name, b) for t in kernels.KERNEL_TYPES for b in (1, 3)}
    for row in r["results"]:
        assert row["fused_ms"] > 0 and row["dequant_matmul_ms"] > 0
        assert abs(row["speedup"] - row["dequant_matmul_ms"] / row["fused_ms"]) < 1e-9
    if r["int8_isa"] not in (None, "scalar"):  # each SIMD path up to the best, timed
        q4k = next(row for row in r["results"] if row["type"] == "Q4_K")
        names = list(q4k["int8_isa_ms"])
        assert names[0] == "avx2" and names[-1] == r["int8_isa"]
        assert all(ms > 0 for ms in q4k["int8_isa_ms"].values())


def test_cli_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvq",
            "bench",
            "kernels",
            "--rows",
            "32",
            "--cols",
            "256",
            "--batches",
            "1",
            "--threads",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    r = json.loads(out.stdout)
    assert r["shape"] == [32, 256] and len(r["results"]) == len(kernels.KERNEL_TYPES)
    assert r["threads"] == 1
