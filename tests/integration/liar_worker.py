"""A dishonest worker for the trust tests: a real `kvq worker` process whose results are
well-formed but wrong on a share of its jobs (issue 11). Nothing in kvq knows about it: the
lie is patched in here, the way an adversary would run modified code.

    python tests/integration/liar_worker.py --id ID --garbage 0.1 --seed 3 [--kind noise|nan]
        [--honest-first N] [--kind scale --factor 1.05] [--label bfloat16]

`KVQ_*` settings come from the environment as for `kvq worker`. Each lie is logged ("LIE job"),
so a test can count the jobs the coordinator received from it. Expert jobs and stage jobs (X12:
the rows leaving a layer span it holds) lie alike. `--honest-first N` answers its
first N jobs honestly (it banks trust) and lies from then on. `--kind scale` multiplies its
honest result by `--factor` (a lie that hides inside a tolerance, if any would), `--kind ortho`
adds noise orthogonal to each row at `--factor` of its norm (no bias to see); `--label`
names its results' compute path whatever it computed (a worker choosing its own tolerance).
"""

from __future__ import annotations

import argparse
import logging
import random

import msgspec
import numpy as np

from kvq import wire
from kvq.bank import server
from kvq.cli import entry
from kvq.worker import shelf

log = logging.getLogger("liar")


def patch(
    garbage: float,
    seed: int,
    kind: str,
    honest_first: int = 0,
    factor: float = 1.05,
    label: str | None = None,
) -> None:
    rng = random.Random(seed)
    honest = server.ExpertServer.handle
    answered = 0

    def lie(res: wire.Result, job_id: str) -> wire.Result:
        nonlocal answered
        answered += 1
        if res.y is None or answered <= honest_first or rng.random() >= garbage:
            return res
        y = res.y.array()
        if kind == "scale":
            bad = (y * factor).astype(np.float32)
        elif kind == "ortho":  # noise orthogonal to each row, `factor` of its norm: no bias
            noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(y.shape)
            dot = (noise * y).sum(1, keepdims=True) / np.maximum(
                (y * y).sum(1, keepdims=True), 1e-30
            )
            noise -= dot * y
            scale = np.linalg.norm(y, axis=1, keepdims=True) / np.maximum(
                np.linalg.norm(noise, axis=1, keepdims=True), 1e-30
            )
            bad = (y + noise * scale * factor).astype(np.float32)
        elif kind == "nan":
            bad = y.copy()
            bad.flat[0] = np.nan
        else:  # same shape and scale, wrong numbers
            noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(y.shape)
            bad = (noise * (np.abs(y).mean() + 1e-3)).astype(np.float32)
        log.warning("LIE job %s", job_id)
        lied = msgspec.structs.replace(res, y=wire.Tensor.of(bad))
        return msgspec.structs.replace(lied, dtype=label) if label else lied

    def handle(self: server.ExpertServer, job: wire.Job) -> wire.Result:
        return lie(honest(self, job), job.job_id)

    def serve_stage(servers: list, job: wire.StageJob) -> wire.Result:  # type: ignore[type-arg]
        return lie(honest_stage(servers, job), job.job_id)

    honest_stage = shelf.serve_stage_job
    server.ExpertServer.handle = handle  # type: ignore[method-assign]
    shelf.serve_stage_job = serve_stage  # type: ignore[assignment]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--id", required=True)
    ap.add_argument("--garbage", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", choices=["noise", "nan", "scale", "ortho"], default="noise")
    ap.add_argument("--factor", type=float, default=1.05)
    ap.add_argument("--label", default=None)
    ap.add_argument("--honest-first", type=int, default=0)
    a = ap.parse_args()
    patch(a.garbage, a.seed, a.kind, a.honest_first, a.factor, a.label)
    entry(["worker", "--id", a.id])
