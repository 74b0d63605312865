"""A forging worker for issue 29 item 6: a real `kvq worker` process that posts forged results
on its own results stream. Each job it gets is answered with a forged result of one kind, and
beside it, results for jobs it never got: an id no coordinator issued, and its guesses of the
next ids the coordinator will issue (the sequence numbers are guessable; the random token each
id ends with is not, so the guesses never name a real job).

    python tests/integration/forger_worker.py --id ID --kind nan|noise|shape

Kinds: `nan` (a NaN in the right shape), `noise` (the right shape and scale, wrong numbers),
`shape` (one row fewer). `KVQ_*` settings come from the environment as for `kvq worker`. Each
forgery is logged ("FORGED job"), so a test can count them.
"""

from __future__ import annotations

import argparse
import logging

import msgspec
import numpy as np

from kvq import wire
from kvq.bank import server
from kvq.bus import connect, xadd
from kvq.cli import entry
from kvq.config import load_settings
from kvq.keys import Keys

log = logging.getLogger("forger")


def patch(worker: str, kind: str) -> None:
    honest = server.ExpertServer.handle
    s = load_settings()
    r, keys = connect(s.bus), Keys(s.prefix)

    def handle(self: server.ExpertServer, job: wire.Job) -> wire.Result:
        res = honest(self, job)
        if res.y is None:
            return res
        y = res.y.array()
        if kind == "nan":
            bad = y.copy()
            bad.flat[0] = np.nan
        elif kind == "shape":
            bad = y[1:].copy() if y.shape[0] > 1 else np.zeros((2, y.shape[1]), np.float32)
        else:
            noise = np.random.default_rng(len(job.job_id)).standard_normal(y.shape)
            bad = (noise * (np.abs(y).mean() + 1e-3)).astype(np.float32)
        # ids are C:N:TOKEN: it guesses the next sequence numbers with its own job's token
        head, _, token = job.job_id.rpartition(":")
        coord, _, seq = head.rpartition(":")
        stream = keys.worker_results(worker, job.coord)
        guesses = (f"{coord}:{int(seq) + i}:{token}" for i in (1, 2, 3))
        for other in (f"{coord}:999999999:{token}", *guesses):
            fake = msgspec.structs.replace(res, job_id=other, y=wire.Tensor.of(bad))
            xadd(r, stream, wire.encode(fake), 1000)
        log.warning("FORGED job %s (%s) and 4 jobs it never got", job.job_id, kind)
        return msgspec.structs.replace(res, y=wire.Tensor.of(bad))

    server.ExpertServer.handle = handle  # type: ignore[method-assign]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--id", required=True)
    ap.add_argument("--kind", choices=["nan", "noise", "shape"], required=True)
    a = ap.parse_args()
    patch(a.id, a.kind)
    entry(["worker", "--id", a.id])
