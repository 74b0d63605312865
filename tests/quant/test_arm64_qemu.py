"""The arm64 paths of the int8 kernels (`csrc/qdot_arm.h`) give the scalar path's bits, for
every type and path, tested on this machine: `arm64/selftest.c` with the kernel sources is
cross-compiled (Debian's gcc-aarch64-linux-gnu, static) and run under qemu-user (Debian's
qemu-user-static), which emulates every extension the paths use with `-cpu max`. Emulation
says nothing of speed: `kvq bench kernels` on an arm64 machine measures that.

The tools come from PATH, or from `.tools/` where `.ci/run` unpacks them without root; the
tests skip, saying so, without them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvq.quant import qdot
from kvq.tools.bench.kernels import _simd_isas

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"
DRIVER = Path(__file__).resolve().parent / "arm64" / "selftest.c"
FLAGS = [f for f in qdot.FLAGS if f not in ("-shared", "-fPIC")]  # the library's, as a program
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "MXFP4")
ARM_PATHS = ("neon", "neon+dotprod", "neon+i8mm")
RUNS = ((1, 1), (2, 1), (3, 1), (4, 3))  # (seed, threads): OpenMP threads change no bit


def _tool(name: str, unpacked: Path) -> str | None:
    found = shutil.which(name)
    return found or (str(unpacked) if unpacked.exists() else None)


CROSS_CC = _tool(
    "aarch64-linux-gnu-gcc", TOOLS / "aarch64" / "usr" / "bin" / "aarch64-linux-gnu-gcc"
)
QEMU = _tool("qemu-aarch64-static", TOOLS / "bin" / "qemu-aarch64-static") or shutil.which(
    "qemu-aarch64"
)
needs_qemu = pytest.mark.skipif(
    CROSS_CC is None or QEMU is None,
    reason="needs an arm64 cross compiler and qemu-user (`.ci/run` unpacks them into .tools/, "
    "or `apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static`)",
)


def _build(cc: str, out: Path, *extra: str) -> Path:
    cmd = [cc, *extra, *FLAGS, "-o", str(out), str(DRIVER), str(qdot.CSRC / "qdot.c"), "-lm"]
    env = dict(os.environ)
    if cc.startswith(str(TOOLS)):  # host libraries .ci/run unpacked beside the compiler
        env["LD_LIBRARY_PATH"] = str(TOOLS / "aarch64" / "usr" / "lib" / "x86_64-linux-gnu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def arm_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert CROSS_CC is not None
    return _build(CROSS_CC, tmp_path_factory.mktemp("arm64") / "selftest", "-static", "-fopenmp")


def _run(driver: Path, cpu: str, seed: int, threads: int = 1) -> str:
    assert QEMU is not None
    cmd = [QEMU, "-cpu", cpu, str(driver), str(seed), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
    return proc.stdout


def _compared(out: str) -> dict[tuple[str, str], int]:
    """(call, path) -> outputs compared, from the driver's `same` lines"""
    return {(m[1], m[2]): int(m[3]) for m in re.finditer(r"^same (\S+) (\S+) (\d+)$", out, re.M)}


@needs_qemu
@pytest.mark.timeout(300)
def test_every_arm64_path_gives_the_scalar_bits(arm_driver: Path) -> None:
    for seed, threads in RUNS:
        out = _run(arm_driver, "max", seed, threads)
        assert out.startswith("best neon+i8mm\n"), out[:200]
        compared = _compared(out)
        for t in TYPES:
            for call in ("dot", "rows", "nan"):  # one row, 11 rows (multi-row), 2 not finite
                for path in ARM_PATHS:
                    assert compared.get((f"{t}/{call}", path), 0) > 0, (t, call, path)
        for path in ARM_PATHS:  # the MoE calls, gate/up/down of each type
            assert sum(n for (c, p), n in compared.items() if "/moe" in c and p == path) > 0


@needs_qemu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("cpu", "best"),
    [("cortex-a53", "neon"), ("cortex-a76", "neon+dotprod")],  # Armv8.0; Armv8.2, no i8mm
)
def test_the_best_path_is_what_the_cpu_has(arm_driver: Path, cpu: str, best: str) -> None:
    out = _run(arm_driver, cpu, 1)
    assert out.startswith(f"best {best}\n"), out[:200]
    beyond = ARM_PATHS[ARM_PATHS.index(best) + 1 :]
    assert not any(p in beyond for _, p in _compared(out)), "a path the CPU lacks ran"


def _hashes(out: str) -> dict[str, str]:
    return dict(re.findall(r"^hash (\S+) (\S+)$", out, re.M))


@needs_qemu
@pytest.mark.timeout(300)
def test_arm64_scalar_path_gives_this_machines_bits(arm_driver: Path, tmp_path: Path) -> None:
    """The same inputs on arm64 and on this machine's build: the same outputs (hashed), so
    an arm64 worker computes what an x86 one does."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for this machine (cc)")
    native = _build(cc, tmp_path / "selftest")
    proc = subprocess.run(
        [str(native), "1"], capture_output=True, text=True, timeout=60, check=True
    )
    here = _hashes(proc.stdout)
    assert sorted(here) == sorted(TYPES)
    assert _hashes(_run(arm_driver, "max", 1)) == here


class _ArmLib:
    """The library's path rule (`kvq_qdot_isa`) on an arm64 CPU with i8mm, as the driver sees
    it under `-cpu max`: -1, a higher id or an x86 one runs the best."""

    def kvq_qdot_best_isa(self) -> int:
        return 7

    def kvq_qdot_isa(self, asked: int) -> int:
        return 7 if asked < 0 or asked > 7 or 0 < asked < 5 else asked


def test_reports_name_the_arm64_paths() -> None:
    """What `kvq bench kernels` (`int8_isa`, `int8_isa_ms`) and a worker's `kernels` line
    (`kernels.describe`, through `Built.isa`) say on such a CPU."""
    built = qdot.Built(_ArmLib(), Path("qdot.so"), True)  # type: ignore[arg-type]
    assert [qdot.ISA_NAMES[i] for i in built.paths()] == [
        "scalar",
        "neon",
        "neon+dotprod",
        "neon+i8mm",
    ]
    assert built.best_isa == "neon+i8mm" and built.isa() == "neon+i8mm" and built.isa(5) == "neon"
    assert built.isa(3) == "neon+i8mm"  # an x86 path asked for on arm64
    assert [qdot.ISA_NAMES[i] for i in _simd_isas(built)] == ["neon", "neon+dotprod", "neon+i8mm"]
    assert "smmla" in qdot.many_rows_kernel("neon+i8mm")
