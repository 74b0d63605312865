"""The one fitting rule of the throughput models: non-negative least squares of relative
errors (`kvq.swarm.calibrate` at expert grain, `kvq.swarm.stage_model` at stage grain)."""

from __future__ import annotations

import numpy as np


def fit(rows: list[list[float]], target: list[float], scale: list[float]) -> list[float]:
    """Least squares of `target` over the columns of `rows`, each row weighted 1 / `scale`
    (relative errors), every coefficient >= 0: a column whose coefficient comes out negative
    is dropped (the most negative first) and the others refitted."""
    a = np.asarray(rows, dtype=np.float64) / np.asarray(scale, dtype=np.float64)[:, None]
    y = np.asarray(target, dtype=np.float64) / np.asarray(scale, dtype=np.float64)
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if keep:
            coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        negative = [i for i in keep if coef[i] < -1e-12]
        if not negative:
            return [max(0.0, float(c)) for c in coef]
        keep.remove(min(negative, key=lambda i: coef[i]))
