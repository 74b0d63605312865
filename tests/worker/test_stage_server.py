"""A worker's stage server (X12) in one process: it keeps each sequence's state between jobs,
refuses a job whole (`StateLost`, the keys named) when rows do not start where a state ends,
drops states on `start` 0 and on `drop`, evicts the least recently used past `max_seqs`, and
runs consecutive spans of one job in order, as the full model would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvq import wire
from kvq.gguf import read_meta
from kvq.gguf.registry import plan_stages
from kvq.model import Backbone, SeqStep
from kvq.model.stage import load_stage, write_stage_file
from kvq.tools.synth import make_tiny
from kvq.worker.fetch import fetch_slice
from kvq.worker.stage import StageServer, serve_stage_job


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stage") / "m.gguf"
    make_tiny(path, arch="olmoe", layers=4, experts=8, seed=1)
    return path


def _servers(model: Path, tmp: Path, max_seqs: int = 8) -> list[StageServer]:
    meta = read_meta(model)
    out = []
    for spec in plan_stages(meta, model, 2):
        blobs = fetch_slice(str(model), spec, 10.0, None)
        sparse = write_stage_file(spec, blobs, tmp / f"{spec.layer_start}.gguf", meta.file_size)
        bb = load_stage(spec, sparse, "cpu", torch.float32)
        out.append(StageServer("w", "m", spec.sid, bb, max_seqs))
    return out


def _job(
    sv: list[StageServer],
    x: np.ndarray,
    seqs: list[tuple[str, int, int]],
    drop: tuple[str, ...] = (),
) -> wire.StageJob:
    return wire.StageJob(
        job_id="j",
        model="m",
        slice=sv[0].sid,
        coord="c",
        reply_to="r",
        deadline_ms=0,
        seqs=[wire.StageSeq(k, s, n) for k, s, n in seqs],
        x=wire.Tensor.of(x),
        drop=list(drop),
        then=[s.sid for s in sv[1:]],
    )


def test_two_spans_in_one_job_give_the_full_models_rows(model: Path, tmp_path: Path) -> None:
    servers = _servers(model, tmp_path)
    full = Backbone.from_gguf(model)
    cache = full.new_cache()
    tokens = [3, 9, 4, 1]
    h = full.embed_tokens(tokens)
    want = full.run_span(h, [cache], [4])  # every block, as the chain must give
    got = serve_stage_job(servers, _job(servers, h.numpy(), [("a", 0, 4)]))
    assert got.error is None and got.y is not None
    assert np.array_equal(got.y.array(), want.numpy())
    # the next token, from where the state ends
    full.advance([SeqStep(tokens, cache)])
    h1 = full.embed_tokens([7])
    want1 = full.run_span(h1, [cache], [1])
    got1 = serve_stage_job(servers, _job(servers, h1.numpy(), [("a", 4, 1)]))
    assert got1.y is not None and np.array_equal(got1.y.array(), want1.numpy())


def test_rows_that_do_not_start_where_a_state_ends_are_refused_whole(
    model: Path, tmp_path: Path
) -> None:
    (sv, _) = _servers(model, tmp_path)
    x = np.ones((3, sv.hidden), np.float32)
    assert serve_stage_job([sv], _job([sv], x[:2], [("a", 0, 2)])).error is None
    before = sv.states[("c", "a")].length
    res = serve_stage_job([sv], _job([sv], x, [("a", 2, 1), ("b", 5, 1), ("c", 0, 1)]))
    assert res.error is not None and res.error.type == wire.STATE_LOST and res.error.retryable
    assert res.lost == ["b"]
    # nothing ran: a's state did not move, c was not made
    assert sv.states[("c", "a")].length == before and ("c", "c") not in sv.states
    # start 0 drops what was kept: a replay
    assert serve_stage_job([sv], _job([sv], x[:1], [("a", 0, 1)])).error is None
    assert sv.states[("c", "a")].length == 1
    # drop frees a finished sequence
    assert serve_stage_job([sv], _job([sv], x[:1], [("b", 0, 1)], drop=("a",))).error is None
    assert ("c", "a") not in sv.states


def test_past_max_seqs_the_least_recently_used_state_goes(model: Path, tmp_path: Path) -> None:
    (sv, _) = _servers(model, tmp_path, max_seqs=2)
    x = np.ones((1, sv.hidden), np.float32)
    for key in ("a", "b", "c"):
        assert serve_stage_job([sv], _job([sv], x, [(key, 0, 1)])).error is None
    assert set(sv.states) == {("c", "b"), ("c", "c")} and sv.evicted == 1
    res = serve_stage_job([sv], _job([sv], x, [("a", 1, 1)]))
    assert res.error is not None and res.lost == ["a"]


def test_a_job_naming_spans_out_of_order_is_a_bad_job(model: Path, tmp_path: Path) -> None:
    first, second = _servers(model, tmp_path)
    x = np.ones((1, first.hidden), np.float32)
    res = serve_stage_job([second, first], _job([second, first], x, [("a", 0, 1)]))
    assert res.error is not None and res.error.type == "BadJob"
    assert "do not follow" in res.error.message
