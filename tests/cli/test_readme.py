"""README "Running it for real" works as written, as a non-root user (issue 12 item 11).

The block runs from the checkout with `bash -e`, in a fresh temporary `HOME`, without `kvq` on
`PATH` (the block itself activates `.venv`), as the `nobody` user when the tests run as root
(unless `.venv`'s interpreter is out of nobody's reach, e.g. a root-only pyenv: then as root).
The one change is the port: 6379 becomes a free one, since other servers may run here. `make
setup` reuses the current `.venv` (it only installs when `pyproject.toml` is newer).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.local.server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running it for real") :]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)[:1]
    return str(block)


@pytest.fixture
def home() -> Iterator[Path]:
    """A world-writable temporary home (pytest's own tmp dirs are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="kvq-readme-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_block_names_what_it_must() -> None:
    block = readme_block()
    assert "/models" not in block and "sudo" not in block, "no root-only paths"
    assert ". .venv/bin/activate" in block, "kvq lives in .venv/bin"
    assert "kvq submit" in block


def others_can_run(path: Path) -> bool:
    """Whether a user with no rights but "other" can execute `path` (and reach it)."""
    real = path.resolve()
    dirs_ok = all(d.stat().st_mode & 0o001 for d in real.parents)
    return dirs_ok and bool(real.stat().st_mode & 0o001)


@pytest.mark.timeout(300)
def test_running_it_for_real_as_written(home: Path) -> None:
    port = free_port()
    script = readme_block().replace("6379", str(port))
    venv_bin = str(ROOT / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVQ_", "VIRTUAL_ENV", "PYTHON"))
    }
    env |= {"HOME": str(home), "PATH": path, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", "-e", "-c", script]
    if os.geteuid() == 0 and others_can_run(ROOT / ".venv" / "bin" / "python"):
        # the README promises a non-root user
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    log = home / "out.log"
    with open(log, "w") as out_file:  # not a pipe: background jobs would hold it open
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=240)
    finally:
        # the block's own `kill $(jobs -p)` stops its processes; this covers a failure midway
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert (home / "kvq" / "model.gguf").is_file()
    assert (home / "kvq" / "redis-data").is_dir()
    assert "Traceback" not in out, out[-4000:]
