"""The image's two stages (`workers/Dockerfile`), run as plain commands (no container engine
here): the build stage's own `pip wheel` line compiles the C kernels into the wheel, and the
run stage, which installs no compiler, loads them from the installed package with no compiler
on its PATH (`kernels: int8 ... (installed)`, what `kvq health worker` reports)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "workers" / "Dockerfile"
COMPILERS = ("gcc", "cc", "clang", "build-essential")


def _stages() -> list[list[str]]:
    """The Dockerfile's stages, each a list of its instructions (continuations joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    stages: list[list[str]] = []
    for ln in lines:
        if ln.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(ln)
    return stages


def test_only_the_build_stage_installs_a_compiler() -> None:
    build, run = _stages()
    assert build[0].endswith(" AS wheel") and any("gcc" in ln for ln in build)
    assert not any(c in shlex.split(ln) for ln in run for c in COMPILERS), run
    assert any(ln.startswith("COPY --from=wheel /wheels") for ln in run)


def _copy(args: list[str], src: Path) -> None:
    """A COPY into /src, as Docker reads it: into a folder when the target ends with `/`."""
    *parts, dest = args
    for p in parts:
        target = src / dest.removeprefix("/src").strip("/")
        if dest.endswith("/"):
            target = target / Path(p).name
        if (ROOT / p).is_dir():
            ignore = shutil.ignore_patterns("*.so", "__pycache__")
            shutil.copytree(ROOT / p, target, ignore=ignore)
        else:
            shutil.copy(ROOT / p, target)


@pytest.mark.slow
def test_the_run_stage_loads_the_kernels_the_build_stage_compiled(tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here to play the build stage")
    build, _ = _stages()
    src = tmp_path / "src"
    src.mkdir()
    for ln in build:
        if ln.startswith("COPY "):
            _copy(ln.split()[1:], src)
    (wheel_line,) = [ln for ln in build if "pip wheel" in ln]
    args = shlex.split(wheel_line.removeprefix("RUN "))
    args = [
        str(tmp_path / "wheels") if a == "/wheels" else str(src) if a == "/src" else a for a in args
    ]
    subprocess.run([sys.executable, "-m", *args[args.index("pip") :]], check=True, timeout=600)
    (wheel,) = (tmp_path / "wheels").glob("kvq-*.whl")
    assert any(n.startswith("kvq/quant/_qdot") for n in zipfile.ZipFile(wheel).namelist())
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = {"PATH": str(tmp_path / "no-compiler"), "HOME": str(tmp_path), "PYTHONPATH": str(site)}
    env.update({k: v for k, v in os.environ.items() if k.startswith("LD_")})
    probe = "import kvq; from kvq.quant.kernels import describe; print(kvq.__file__); print(describe('cpu'))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,  # not the checkout, whose kvq would come first
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith(str(site)), "the installed package, not the checkout"
    assert out[1].startswith("int8 ") and out[1].endswith("(installed)"), out
