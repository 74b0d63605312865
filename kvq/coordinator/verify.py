"""Spot-checks on the hot path: a sampled remote result is recomputed *before* it is used.

`KVQ_VERIFY_REMOTE` says which results are recomputed: `sampled` (the default: graded trust,
`kvq.coordinator.trust`), `all`, or `off`. Whatever it says, a result holding NaN or infinity
is never used: it is recomputed here and counts as a lie (an honest worker sends a `NonFinite`
error instead, `kvq.worker.server`). A checked result that agrees is replaced by the local
recomputation (float32, and already paid for); one that does not is a mismatch: the local
result is used, the worker is quarantined (recorded on the board, so every coordinator of the
model stops using it at its next coverage refresh) and, after repeated mismatches, banned.

Attribution is by the worker the job was sent to, and a result must name that worker (see
`Dispatcher.accept`); a process that can write to the results stream and names the right worker
is blamed on it: per-worker result streams (ACL, another branch) close that gap.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch

from kvq.bus.board import Board
from kvq.bus.records import DispatchCounters
from kvq.coordinator.check import Comparison, compare, finite, tolerance
from kvq.coordinator.trust import Trust

log = logging.getLogger("kvq.coordinator")


class Verdict(enum.Enum):
    USED = "used"  # not checked: the remote result is used as it is
    VERIFIED = "verified"  # checked and equal within the dtype's tolerance: proves the worker
    REJECTED = "rejected"  # non-finite or a mismatch: the worker was caught


class Verifier:
    """Checks remote results of one model for one coordinator and records verdicts."""

    def __init__(
        self, board: Board, model: str, trust: Trust, mode: str, local_dtype: str,
        stats: DispatchCounters, on_caught: Callable[[str], None] = lambda worker: None,
    ) -> None:  # fmt: skip
        self.board, self.model, self.trust, self.mode = board, model, trust, mode
        self.local_dtype, self.stats, self.on_caught = local_dtype, stats, on_caught

    def barred(self, worker: str) -> bool:
        """Quarantined or banned: nothing it sends is used."""
        return self.trust.barred(worker)

    def judge(
        self, worker: str, y: torch.Tensor, dtype: str, recompute: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, Verdict]:
        """The tensor to use in place of remote result `y` ([R, H]) of `worker`, and why."""
        self.stats.remote_rows += int(y.shape[0])
        if not finite(y):
            self.stats.nonfinite_results += 1
            self.caught(worker, "its result holds NaN or infinity")
            return recompute(), Verdict.REJECTED
        if self.mode == "off" or (self.mode == "sampled" and not self.trust.should_check(worker)):
            return y, Verdict.USED
        ref = recompute()
        return ref, self.check(worker, y, dtype, ref)

    def check(self, worker: str, y: torch.Tensor, dtype: str, ref: torch.Tensor) -> Verdict:
        """Compare `y` with this coordinator's `ref`; record the outcome."""
        c: Comparison = compare(y, ref, tolerance(dtype, self.local_dtype))
        st = self.stats
        st.verified += 1
        st.verified_rows += int(ref.shape[0])
        if c.finite and c.abs_err != float("inf"):
            st.max_abs_err = max(st.max_abs_err, c.abs_err)
        if c.ok:
            self.trust.passed(worker)
            return Verdict.VERIFIED
        st.mismatches += 1
        why = "non-finite values" if not c.finite else f"relative row error {c.rel_err:.3g}"
        self.caught(worker, f"{why} > {tolerance(dtype, self.local_dtype):g} ({dtype} result)")
        return Verdict.REJECTED

    def caught(self, worker: str, reason: str) -> None:
        """Quarantine `worker` here and on the board (every coordinator of the model)."""
        verdict = self.trust.failed(worker, reason)
        self.stats.quarantines += 1
        self.board.quarantine(self.model, worker, verdict)
        log.warning(
            "worker %s returned a wrong result (%s): %s for %.0f s (mismatch %d)", worker,
            reason, "banned" if verdict.banned else "quarantined",
            self.trust.policy.quarantine_s, verdict.mismatches,
        )  # fmt: skip
        self.on_caught(worker)
