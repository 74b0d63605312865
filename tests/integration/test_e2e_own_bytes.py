"""The coordinator checks its own bytes before it blames anyone (X3).

A coordinator recomputes sampled remote results from its own copy of the model file. With one
byte of an expert range flipped in that copy, every honest holder of the slice would look like
a liar. Instead the coordinator finds the corrupted range (its background pass, or at once
before a mismatch on the slice is charged), names it and stops (`ModelCorrupt`); no worker is
quarantined, and a coordinator with the registered file serves the request."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from e2e_helpers import local_tokens

from kvq import client
from kvq.bus import connect
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.bus.redis_board import open_board
from kvq.catalog import ModelInfo
from kvq.config import Settings, child_env
from kvq.coordinator.own_bytes import OwnBytes
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verifier
from kvq.errors import ModelCorrupt
from kvq.gguf.registry import plan_model
from kvq.keys import Keys
from kvq.local.procs import Children

pytestmark = pytest.mark.slow


def _corrupt_copy(model: Path, info: ModelInfo, to: Path) -> tuple[str, int]:
    """`model` with one byte flipped in the middle of the last range of its last slice (the
    start-up check reads only the first); returns that slice's id and the offset."""
    shutil.copyfile(model, to)
    sid = max(info.slices)
    r = info.slices[sid].ranges[-1]
    at = r.offset + r.nbytes // 2
    with open(to, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
    return sid, at


def test_a_mismatch_on_a_corrupted_local_slice_blames_no_worker(
    tiny_model: Path, tmp_path: Path
) -> None:
    info = plan_model("tiny", tiny_model, 1, 4)
    bad_sid, at = _corrupt_copy(tiny_model, info, tmp_path / "bad.gguf")
    own = OwnBytes(tmp_path / "bad.gguf", info)
    assert all(own.check(sid) == "" for sid in info.slices if sid != bad_sid)
    why = own.check(bad_sid)
    assert f"at offset {info.slices[bad_sid].ranges[-1].offset}" in why and bad_sid in why
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    v = Verifier(MemoryBoard(), "tiny", trust, "all", "q8", DispatchCounters())
    v.own_bytes = own.refuse
    y = torch.ones(2, 8)
    with pytest.raises(ModelCorrupt, match="no worker is blamed"):
        v.check("honest", y, "q8", y + 1, sid=bad_sid)
    assert not v.barred("honest") and v.stats.mismatches == 0
    # an intact slice's mismatch is the worker's, as before
    ok_sid = min(info.slices)
    v.check("liar", y, "q8", y + 1, sid=ok_sid)
    assert v.barred("liar")


@pytest.mark.timeout(300)
def test_a_coordinator_on_a_corrupted_file_stops_and_another_serves(
    settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"coordinator_experts": "none", "verify_remote": "all"})
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        kids.spawn("monitor", "monitor", "--model", f"tiny={tiny_model}")
        kids.wait_for(lambda: "tiny" in board.models(), 120, "registration")
        info = board.model_info("tiny")
        assert info is not None
        bad_sid, _ = _corrupt_copy(tiny_model, info, tmp_path / "bad.gguf")
        kids.spawn("w0", "worker", "--id", "w0")
        kids.wait_for(lambda: any(v.ready for v in board.workers("tiny")), 120, "a worker")
        kids.spawn(
            "c1",
            "coordinator",
            "--model",
            str(tmp_path / "bad.gguf"),
            "--model-id",
            "tiny",
            "--id",
            "c1",
        )
        assert kids.procs["c1"].wait(120) != 0
        log = (tmp_path / "c1.log").read_text()
        assert "ModelCorrupt" in log and bad_sid in log, log[-2000:]
        kids.spawn(
            "c2", "coordinator", "--model", str(tiny_model), "--model-id", "tiny", "--id", "c2"
        )
        r = connect(s.bus)
        try:
            got = client.generate(
                r, Keys(s.prefix), "tiny", prompt="own bytes", max_tokens=6, timeout_s=120
            )
        finally:
            r.close()
        assert got == local_tokens(tiny_model, "own bytes", 6)
        assert board.quarantined("tiny") == {}, "no honest worker blamed"
    finally:
        kids.stop_all()
