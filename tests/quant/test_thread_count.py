"""`OMP_NUM_THREADS` holds in a kvq process after numba's pool starts.

numba's OpenMP pool sets the process's OpenMP thread count to its own size when it starts,
and torch shares that count: before the fix, `OMP_NUM_THREADS=1` processes ran 2 threads
on 2 CPUs after their first expert call (and `kvq.coordinator.routing` read the wrong
count)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import torch
from kvq.quant import kernels
from gguf import GGMLQuantizationType as Q
x = torch.randn(3, 32)
raw = torch.zeros(4, 34, dtype=torch.uint8)  # 4 rows of one Q8_0 block: scale 0, all zero
kernels.matmul_float32(x, raw, int(Q.Q8_0))
import numba
print(torch.get_num_threads(), numba.get_num_threads())
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_omp_num_threads_survives_the_first_kernel_call(threads: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "OMP_NUM"))}
    env["OMP_NUM_THREADS"] = threads
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert out == [threads, threads]


def test_a_child_sizes_its_own_pool() -> None:
    """The pool's size is not left in the environment, where children (started by a process
    that imported the kernels, e.g. pytest or `kvq demo`) would inherit the parent's size."""
    parent = "import os, subprocess, sys\nfrom kvq.quant import kernels\n" + (
        "env = dict(os.environ, OMP_NUM_THREADS='1')\n"
        "print(subprocess.run([sys.executable, '-c', sys.argv[1]], env=env, "
        "capture_output=True, text=True, check=True).stdout)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "OMP_NUM"))}
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run(
        [sys.executable, "-c", parent, PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    ).stdout.split()
    assert out == ["1", "1"]
