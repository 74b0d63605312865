"""The C kernels built when kvq is installed (`setup.py`): built from these sources, used
before any build at first use, the same bits as that build, and never used stale."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvq.quant import qdot
from kvq.tools.synth.quants import random_blocks

ROOT = Path(__file__).resolve().parents[2]


def setup_py_key() -> str:
    """`sources_key` as setup.py computes it at install (it cannot import kvq)."""
    spec = importlib.util.spec_from_file_location("kvq_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    source = (ROOT / "setup.py").read_text().split("\nsetup(")[0]  # definitions, no build
    namespace: dict[str, object] = {"__name__": "kvq_setup", "__file__": str(ROOT / "setup.py")}
    exec(compile(source, "setup.py", "exec"), namespace)
    return str(namespace["sources_key"]())  # type: ignore[operator]


def test_setup_and_the_runtime_hash_the_sources_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert setup_py_key() == qdot.sources_key()


@pytest.fixture(scope="module")
def installed_lib(tmp_path_factory: pytest.TempPathFactory) -> qdot.Built:
    """The library as `pip install` builds it: setup.py's build_ext, into a scratch folder."""
    out = tmp_path_factory.mktemp("install")
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if not list(out.glob("kvq/quant/_qdot*.so")):
        pytest.skip(f"no C compiler here: nothing built at install ({proc.stdout[-300:]})")
    return out / "kvq" / "quant"  # type: ignore[return-value]


def test_the_installed_library_is_used_first_and_says_so(
    installed_lib: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(qdot, "INSTALL_DIR", installed_lib)
    monkeypatch.setattr(qdot, "_loaded", {})
    got = qdot.load(str(tmp_path / "no-such-cc"), tmp_path)  # no compiler at run time
    assert got is not None and got.origin == qdot.INSTALLED
    assert got.path.parent == installed_lib and got.openmp
    assert not list(tmp_path.iterdir())  # nothing built at first use


def test_a_library_built_from_other_sources_is_not_used(
    installed_lib: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(qdot, "INSTALL_DIR", installed_lib)
    monkeypatch.setattr(qdot, "_loaded", {})
    monkeypatch.setattr(qdot, "sources_key", lambda: "0123456789abcdef")  # the C files changed
    assert qdot.installed() is None
    got = qdot.load("cc", tmp_path)
    assert got is not None and got.origin == qdot.FIRST_USE


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_installed_and_first_use_builds_give_the_same_bits(
    installed_lib: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, qtype: Q
) -> None:
    monkeypatch.setattr(qdot, "INSTALL_DIR", installed_lib)
    inst = qdot.installed()
    assert inst is not None
    first = qdot.build("cc", tmp_path)
    rng = np.random.default_rng(7)
    raw = random_blocks(qtype, (45, 1024), 0.02, rng)  # [rows, row bytes]
    for batch in (1, 3, 9, 40):  # one-row, few-row, multi-row and tile paths
        x = rng.standard_normal((batch, 1024), dtype=np.float32)
        for isa in (0, 1, 2, 3, 4):
            a = qdot.matmul(inst, x, raw, qtype, 2, isa)
            b = qdot.matmul(first, x, raw, qtype, 2, isa)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (qtype.name, batch, isa)
