"""Routing histograms (B3): the HIST.json format, its validation, and re-ranking (numpy only).

    {"model": "<name>",
     "layers": [{"layer": 0, "counts": [routed pairs per expert], "expert_bytes": [bytes per expert]},
                ...]}

`counts[e]` is how many (token, expert) routings chose expert e of that layer in the sample;
`expert_bytes[e]` is the size of that expert's gate+up+down weights in the model file. See
`docs/bank.md`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvq.bank.planner import F64, LayerTable, check_tables, table
from kvq.errors import BankError

DEFAULT_PRIOR_PER_EXPERT = 16.0


@dataclass(frozen=True)
class Histogram:
    """Routing counts and expert sizes of one model, per layer (validated, sorted by layer)."""

    model: str
    layers: list[LayerTable]

    def layer(self, layer: int) -> LayerTable:
        for t in self.layers:
            if t.layer == layer:
                return t
        raise BankError(f"histogram of {self.model!r} has no layer {layer}")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": [
                {
                    "layer": t.layer,
                    "counts": [int(c) for c in t.counts.tolist()],
                    "expert_bytes": t.expert_bytes.tolist(),
                }
                for t in self.layers
            ],
        }


def hist_from_json(doc: object, source: str = "histogram") -> Histogram:
    """A validated Histogram from its JSON form; BankError naming the bad layer or expert."""
    if not isinstance(doc, Mapping):
        raise BankError(f"{source}: top level must be an object with 'model' and 'layers'")
    model, layers = doc.get("model"), doc.get("layers")
    if not isinstance(model, str):
        raise BankError(f"{source}: 'model' must be a string, got {model!r}")
    if not isinstance(layers, list) or not layers:
        raise BankError(f"{source}: 'layers' must be a non-empty list of layer objects")
    tables = []
    for i, row in enumerate(layers):
        if not isinstance(row, Mapping) or any(k not in row for k in _LAYER_KEYS):
            raise BankError(f"{source}: layers[{i}] must have keys {', '.join(_LAYER_KEYS)}")
        for key in ("counts", "expert_bytes"):
            if not isinstance(row[key], list):
                raise BankError(f"{source}: layers[{i}].{key} must be a list of numbers")
        tables.append(table(row["layer"], row["counts"], row["expert_bytes"]))
    return Histogram(model, check_tables(tables))


_LAYER_KEYS = ("layer", "counts", "expert_bytes")


def load_hist(path: str | Path) -> Histogram:
    """Read and validate a HIST.json file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise BankError(f"histogram file {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BankError(f"histogram file {str(path)!r} is not JSON: {exc}") from None
    return hist_from_json(doc, str(path))


def save_hist(hist: Histogram, path: str | Path) -> None:
    Path(path).write_text(json.dumps(hist.to_json()) + "\n", encoding="utf-8")


def rerank(
    ref: Histogram, traffic: Histogram, prior_per_expert: float = DEFAULT_PRIOR_PER_EXPERT
) -> Histogram:
    """The reference histogram re-ranked for your own traffic.

    Per layer, the reference's shares are a prior worth `prior_per_expert` routings per expert;
    the traffic's counts are the evidence. Output counts (rounded to integers) are
    `traffic[e] + prior_per_expert * E * ref_share[e]`: a small sample mostly keeps the
    reference's ranking, a large one overrides it. Expert sizes come from the reference.
    """
    if not prior_per_expert >= 0 or not np.isfinite(prior_per_expert):
        raise BankError(f"prior {prior_per_expert!r} must be a finite number >= 0")
    if ref.model != traffic.model:
        raise BankError(
            f"reference is for model {ref.model!r} but the traffic is from {traffic.model!r}"
        )
    live = {t.layer: t for t in traffic.layers}
    extra = sorted(set(live) - {t.layer for t in ref.layers})
    if extra:
        raise BankError(f"traffic has layers {extra} that the reference lacks")
    out = []
    for r in ref.layers:
        t = live.get(r.layer)
        evidence = np.zeros_like(r.counts) if t is None else _matching(r, t)
        total = float(r.counts.sum())
        share = r.counts / total if total > 0 else np.full(r.counts.size, 1.0 / r.counts.size)
        counts = np.rint(evidence + prior_per_expert * r.counts.size * share)  # [E]
        out.append(table(r.layer, counts, r.expert_bytes))
    return Histogram(ref.model, out)


def _matching(ref: LayerTable, live: LayerTable) -> F64:
    if live.counts.size != ref.counts.size:
        raise BankError(
            f"layer {ref.layer}: the traffic has {live.counts.size} experts, "
            f"the reference {ref.counts.size}"
        )
    return live.counts


def merge_counts(
    model: str, counts: Mapping[int, Sequence[float]], sizes: Mapping[int, Sequence[int]]
) -> Histogram:
    """A Histogram from per-layer count and size lists (what a collector produces)."""
    return Histogram(
        model, check_tables(table(layer, counts[layer], sizes[layer]) for layer in sorted(counts))
    )
