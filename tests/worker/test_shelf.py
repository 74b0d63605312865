"""`Shelf`: one inbox's jobs, each to the slice of its own model (issue 10 item 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.model import load_slice, make_tiny, read_meta
from kvq.worker.server import BAD_JOB, ExpertServer
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


def _job(model: str, hidden: int, layer: int, lo: int, hi: int, job_id: str) -> wire.Job:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    ids = np.array([[lo, lo + 1], [hi - 1, lo]], dtype=np.int32)
    w = np.full((2, 2), 0.5, dtype=np.float32)
    return wire.Job(
        job_id=job_id, model=model, layer=layer, slice="s", expert_start=lo, expert_end=hi,
        coord="c", reply_to="r", deadline_ms=0, x=wire.Tensor.of(x), ids=wire.Tensor.of(ids),
        weights=wire.Tensor.of(w),
    )  # fmt: skip


def test_each_job_goes_to_the_server_of_its_model(servers: dict[str, ExpertServer]) -> None:
    shelf = Shelf("w")
    shelf.add("a", servers["a"], 100)
    shelf.add("b", servers["b"], 50)
    assert len(shelf) == 2 and shelf.used_bytes == 150 and list(shelf) == ["a", "b"]
    ja, jb = _job("a", 64, 0, 0, 4, "ja"), _job("b", 32, 1, 4, 8, "jb")
    ra, rb = shelf.handle(ja), shelf.handle(jb)
    assert ra.error is None and rb.error is None and ra.y is not None and rb.y is not None
    assert np.array_equal(ra.y.array(), servers["a"].handle(ja).y.array())  # type: ignore[union-attr]
    assert ra.y.shape == [2, 64] and rb.y.shape == [2, 32]
    served, last = shelf.served()
    assert served >= 2 and last > 0


def test_a_job_for_a_model_not_held_is_a_bad_job(servers: dict[str, ExpertServer]) -> None:
    shelf = Shelf("w")
    shelf.add("a", servers["a"], 100)
    res = shelf.handle(_job("b", 32, 1, 4, 8, "jb"))
    assert res.error is not None and res.error.type == BAD_JOB and res.y is None
    assert "holds no slice of b" in res.error.message and "a layers [0]" in res.error.message
    wrong = shelf.handle(_job("a", 64, 1, 0, 4, "wrong-layer"))
    assert wrong.error is not None and wrong.error.type == BAD_JOB, "the server still checks"


def test_dropping_a_slice_frees_it_and_keeps_the_work_counters_growing(
    servers: dict[str, ExpertServer],
) -> None:
    shelf = Shelf("w")
    shelf.add("a", servers["a"], 100)
    shelf.add("b", servers["b"], 50)
    shelf.handle(_job("b", 32, 1, 4, 8, "jb"))
    busy, rows = shelf.work()
    assert shelf.drop("b") is servers["b"] and shelf.drop("b") is None
    assert shelf.used_bytes == 100 and "b" not in shelf.last_job
    assert shelf.work() == (busy, rows), "the heartbeat's load never sees time run backwards"
    assert shelf.served()[0] == servers["a"].served, "served counts the slices held now"
