"""`Shelf`: one inbox's jobs, each to the server of its own model and slice (issue 10 item 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import BAD_JOB, ExpertServer
from kvq.gguf import read_meta
from kvq.model import load_slice
from kvq.tools.synth import make_tiny
from kvq.worker.shelf import Shelf

_OPTS = BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ExpertServer]:
    """Model "a" (hidden 64) experts [0, 4) of layer 0; model "b" (hidden 32) [4, 8) of 1."""
    d = tmp_path_factory.mktemp("shelf")
    out = {}
    for model, hidden, layer, lo, hi in (("a", 64, 0, 0, 4), ("b", 32, 1, 4, 8)):
        path = d / f"{model}.gguf"
        make_tiny(path, layers=2, experts=8, hidden=hidden, seed=len(out))
        meta = read_meta(path)
        bank = Bank([load_slice(path, meta, layer, lo, hi)], _OPTS, "cpu")
        out[model] = ExpertServer("w", model, bank, hidden, torch.float32)
    return out


def _job(
    model: str, hidden: int, layer: int, lo: int, hi: int, job_id: str, sid: str = "s"
) -> wire.Job:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    ids = np.array([[lo, lo + 1], [hi - 1, lo]], dtype=np.int32)
    w = np.full((2, 2), 0.5, dtype=np.float32)
    return wire.Job(
        job_id=job_id,
        model=model,
        layer=layer,
        slice=sid,
        expert_start=lo,
        expert_end=hi,
        coord="c",
        reply_to="r",
        deadline_ms=0,
        x=wire.Tensor.of(x),
        ids=wire.Tensor.of(ids),
        weights=wire.Tensor.of(w),
    )


def test_each_job_goes_to_the_server_of_its_slice(servers: dict[str, ExpertServer]) -> None:
    shelf = Shelf("w")
    shelf.add("a", "s", servers["a"], 100)
    shelf.add("b", "s", servers["b"], 50)
    assert len(shelf) == 2 and shelf.used_bytes == 150 and list(shelf) == [("a", "s"), ("b", "s")]
    ja, jb = _job("a", 64, 0, 0, 4, "ja"), _job("b", 32, 1, 4, 8, "jb")
    ra, rb = shelf.handle(ja), shelf.handle(jb)
    assert ra.error is None and rb.error is None and ra.y is not None and rb.y is not None
    assert np.array_equal(ra.y.array(), servers["a"].handle(ja).y.array())  # type: ignore[union-attr]
    assert ra.y.shape == [4, 64] and rb.y.shape == [4, 32]  # one row per (row, expert) pair
    served, last = shelf.served()
    assert served >= 2 and last > 0


def test_a_job_for_a_model_not_held_is_a_bad_job(servers: dict[str, ExpertServer]) -> None:
    shelf = Shelf("w")
    shelf.add("a", "s", servers["a"], 100)
    res = shelf.handle(_job("b", 32, 1, 4, 8, "jb"))
    assert res.error is not None and res.error.type == BAD_JOB and res.y is None
    assert "holds no slice of b" in res.error.message
    other = shelf.handle(_job("a", 64, 0, 0, 4, "other-slice", sid="t"))
    assert other.error is not None and other.error.type == BAD_JOB
    assert "holds slice(s) s of a, not that one" in other.error.message
    wrong = shelf.handle(_job("a", 64, 1, 0, 4, "wrong-layer"))
    assert wrong.error is not None and wrong.error.type == BAD_JOB, "the server still checks"


def test_dropping_a_slice_frees_it_and_keeps_the_work_counters_growing(
    servers: dict[str, ExpertServer],
) -> None:
    shelf = Shelf("w")
    shelf.add("a", "s", servers["a"], 100)
    shelf.add("b", "s", servers["b"], 50)
    shelf.handle(_job("b", 32, 1, 4, 8, "jb"))
    busy, rows = shelf.work()
    assert shelf.drop("b", "s") is servers["b"] and shelf.drop("b", "s") is None
    assert shelf.used_bytes == 100 and ("b", "s") not in shelf.last_job
    assert shelf.work() == (busy, rows), "the heartbeat's load never sees time run backwards"
    assert shelf.served()[0] == servers["a"].served, "served counts the slices held now"


def test_two_slices_of_one_model_each_serve_their_own_jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = tmp_path_factory.mktemp("shelf2")
    path = d / "m.gguf"
    make_tiny(path, layers=1, experts=8, hidden=32, seed=3)
    meta = read_meta(path)
    shelf = Shelf("w")
    for sid, lo, hi in (("lo", 0, 4), ("hi", 4, 8)):
        bank = Bank([load_slice(path, meta, 0, lo, hi)], _OPTS, "cpu")
        shelf.add("m", sid, ExpertServer("w", "m", bank, 32, torch.float32), 10)
    assert shelf.models() == {"m"} and len(shelf) == 2
    ok_lo, ok_hi = (
        shelf.handle(_job("m", 32, 0, 0, 4, "a", "lo")),
        shelf.handle(_job("m", 32, 0, 4, 8, "b", "hi")),
    )
    assert ok_lo.error is None and ok_hi.error is None
    crossed = shelf.handle(_job("m", 32, 0, 4, 8, "c", "lo"))  # hi's experts sent as "lo"
    assert crossed.error is not None and crossed.error.type == BAD_JOB
