"""kvq.bank.hist: the HIST.json format, its validation, and re-ranking (B3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvq.bank.hist import Histogram, hist_from_json, load_hist, rerank, save_hist
from kvq.bank.planner import table
from kvq.errors import BankError


def doc(**layer0: object) -> dict[str, object]:
    row = {"layer": 0, "counts": [3, 1, 2], "expert_bytes": [10, 10, 10]} | layer0
    return {
        "model": "m",
        "layers": [row, {"layer": 1, "counts": [0, 5, 1], "expert_bytes": [10, 10, 10]}],
    }


def test_round_trip(tmp_path: Path) -> None:
    h = hist_from_json(doc())
    save_hist(h, tmp_path / "h.json")
    again = load_hist(tmp_path / "h.json")
    assert again.to_json() == h.to_json() == doc()
    assert again.layer(1).counts.tolist() == [0, 5, 1]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([], "top level"),
        ({"layers": []}, "'model'"),
        ({"model": "m", "layers": []}, "non-empty"),
        ({"model": "m", "layers": [{"layer": 0}]}, r"layers\[0\] must have keys"),
        (doc(counts=[1, -1, 2]), "layer 0 expert 1: .*negative"),
        (doc(counts=[1, 2]), "layer 0: 2 counts but 3 expert sizes"),
        (doc(counts="123"), r"layers\[0\].counts must be a list"),
        (doc(counts=[1, None, 2]), "layer 0 expert 1: .*NaN"),
        (doc(layer=1), "layer 1 appears twice"),
    ],
)
def test_invalid_histograms(bad: object, match: str) -> None:
    with pytest.raises(BankError, match=match):
        hist_from_json(bad)


def test_nan_in_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "h.json"
    p.write_text(
        '{"model": "m", "layers": [{"layer": 0, "counts": [1, NaN], "expert_bytes": [1, 1]}]}'
    )
    with pytest.raises(BankError, match="layer 0 expert 1: .*NaN"):
        load_hist(p)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(BankError, match="does not exist"):
        load_hist(tmp_path / "nope.json")
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(BankError, match="not JSON"):
        load_hist(tmp_path / "b.json")


def test_missing_layer_is_named() -> None:
    with pytest.raises(BankError, match="no layer 4"):
        hist_from_json(doc()).layer(4)


def _hist(model: str, *layers: list[int]) -> Histogram:
    return Histogram(model, [table(i, c, [8] * len(c)) for i, c in enumerate(layers)])


def test_rerank_small_sample_keeps_reference_order() -> None:
    ref = _hist("m", [1000, 500, 100, 10])
    live = _hist("m", [0, 1, 2, 0])  # three routings: too little to overturn the reference
    out = rerank(ref, live)
    order = np.argsort(-out.layers[0].counts, kind="stable")
    assert order.tolist() == [0, 1, 2, 3]


def test_rerank_large_sample_wins() -> None:
    ref = _hist("m", [1000, 500, 100, 10])
    live = _hist("m", [0, 50, 2000, 900])
    out = rerank(ref, live, prior_per_expert=16)
    order = np.argsort(-out.layers[0].counts, kind="stable")
    assert order.tolist()[:2] == [2, 3]
    assert out.layers[0].expert_bytes.tolist() == [8, 8, 8, 8]
    assert all(float(c).is_integer() for c in out.layers[0].counts)


def test_rerank_zero_prior_is_the_traffic() -> None:
    out = rerank(_hist("m", [5, 5]), _hist("m", [1, 9]), prior_per_expert=0)
    assert out.layers[0].counts.tolist() == [1, 9]


def test_rerank_layers_missing_from_traffic_keep_the_reference() -> None:
    ref = _hist("m", [4, 1], [1, 4])
    live = Histogram("m", [table(1, [0, 100], [8, 8])])
    out = rerank(ref, live, prior_per_expert=1)
    assert out.layers[0].counts.tolist() == [2, 0]  # 1 * 2 experts * (0.8, 0.2), rounded
    assert out.layers[1].counts.tolist()[1] > out.layers[1].counts.tolist()[0]


@pytest.mark.parametrize(
    ("live", "match"),
    [
        (_hist("other", [1, 2]), "model 'm'.*'other'"),
        (_hist("m", [1, 2, 3]), "layer 0: the traffic has 3 experts"),
        (_hist("m", [1, 2], [1, 2], [3, 4]), r"layers \[2\]"),
    ],
)
def test_rerank_mismatches(live: Histogram, match: str) -> None:
    with pytest.raises(BankError, match=match):
        rerank(_hist("m", [1, 2], [3, 4]), live)


def test_rerank_bad_prior() -> None:
    with pytest.raises(BankError, match="prior"):
        rerank(_hist("m", [1]), _hist("m", [1]), prior_per_expert=float("nan"))


def test_json_is_plain(tmp_path: Path) -> None:
    save_hist(_hist("m", [1, 2]), tmp_path / "h.json")
    loaded = json.loads((tmp_path / "h.json").read_text())
    assert loaded == {
        "model": "m",
        "layers": [{"layer": 0, "counts": [1, 2], "expert_bytes": [8, 8]}],
    }
