"""Spot-checks on the hot path: a sampled remote result is recomputed *before* it is used.

`KVQ_VERIFY_REMOTE` says which results are recomputed: `sampled` (the default: graded trust,
`kvq.coordinator.trust`), `all`, or `off`. Whatever it says, a result holding NaN or infinity
is never used: it is recomputed here and counts as a lie (an honest worker sends a `NonFinite`
error instead, `kvq.bank.server`). A checked result that agrees is replaced by the local
recomputation (float32, and already paid for); one that does not is a mismatch: the local
result is used, the worker is quarantined (recorded on the board, so every coordinator of the
model stops using it at its next coverage refresh) and, after repeated mismatches, banned.

The coordinator says how a result is checked: each job asks for a compute path (`asked`: this
coordinator's own, so `q8` against `q8`, or `f32cpu` against `f32cpu`, is a bitwise check), and
a result labelled with another is refused and counted as a lie. A worker that cannot run the path asked (a CUDA worker) fails
the job with `WrongDType` naming its own; the coordinator then asks it for that one only if it
is a GPU path it checks by tolerance (`NEGOTIABLE`) and the operator admitted the worker to it
(`KVQ_GPU_WORKERS`), never for a looser CPU label: a worker cannot loosen its own check by
saying it runs a GPU. One not admitted keeps being asked for the coordinator's path (its jobs
fail, and routing prices it out).

Attribution is by the worker the job was sent to, and a result must name that worker (see
`Dispatcher.accept`); a process that can write to the results stream and names the right worker
is blamed on it: per-worker result streams (ACL, another branch) close that gap.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch

from kvq import wire
from kvq.bus.board import Board
from kvq.bus.records import DispatchCounters
from kvq.coordinator.check import (
    BIAS_WINDOW,
    MEAN_BIAS_TOLERANCE,
    MEAN_ROW_TOLERANCE,
    Comparison,
    bias_tolerance,
    compare,
    deterministic,
    finite,
    tolerance,
)
from kvq.coordinator.pending import Answer
from kvq.coordinator.trust import Trust
from kvq.quant import kernels

log = logging.getLogger("kvq.coordinator")


class Verdict(enum.Enum):
    USED = "used"  # not checked: the remote result is used as it is
    VERIFIED = "verified"  # checked and equal within the dtype's tolerance: proves the worker
    REJECTED = "rejected"  # non-finite or a mismatch: the worker was caught


# paths a worker may ask to compute in instead of the coordinator's: the GPU dtypes, each
# checked by its own measured tolerance (`kvq.coordinator.check`)
NEGOTIABLE = ("bfloat16", "float16")
WRONG_DTYPE = "WrongDType"  # kvq.bank.server.WRONG_DTYPE


class Verifier:
    """Checks remote results of one model for one coordinator and records verdicts."""

    def __init__(
        self,
        board: Board,
        model: str,
        trust: Trust,
        mode: str,
        local_dtype: str,
        stats: DispatchCounters,
        on_caught: Callable[[str], None] = lambda worker: None,
        gpu_admitted: Callable[[str], bool] = lambda worker: False,
    ) -> None:
        self.board, self.model, self.trust, self.mode = board, model, trust, mode
        self.gpu_admitted = gpu_admitted  # KVQ_GPU_WORKERS (`admitted`)
        self._refused_claims: set[str] = set()  # workers told once that their claim is not granted
        self.local_dtype, self.stats, self.on_caught = local_dtype, stats, on_caught
        self.paths: dict[str, str] = {}  # worker -> the path asked of it, if not local_dtype
        # raises ModelCorrupt if this coordinator's own bytes of a slice are corrupted: run
        # before a mismatch on that slice is charged to a worker (`kvq.coordinator.own_bytes`)
        self.own_bytes: Callable[[str], None] = lambda sid: None
        self.biases: dict[str, list[float]] = {}  # worker -> its last checked results' biases
        self.errors: dict[str, list[float]] = {}  # worker -> their relative row errors

    def asked(self, worker: str) -> wire.ComputeDType:
        """The compute path this coordinator asks of `worker` (and checks against)."""
        return self.paths.get(worker, self.local_dtype)  # type: ignore[return-value]

    def refused(self, worker: str, error: wire.Failure) -> None:
        """`worker` failed a job: if because it runs another path that this coordinator can
        check (a GPU dtype) and the operator admitted it to one, ask it for that path from now
        on."""
        if error.type == WRONG_DTYPE and error.message in NEGOTIABLE:
            if not self.gpu_admitted(worker):
                if worker not in self._refused_claims:
                    self._refused_claims.add(worker)
                    log.warning(
                        "worker %s computes in %s but is not in KVQ_GPU_WORKERS: its "
                        "jobs keep asking for %s (it serves none until admitted)",
                        worker,
                        error.message,
                        self.local_dtype,
                    )
                return
            if self.paths.get(worker) != error.message:
                log.info(
                    "worker %s computes in %s: its jobs ask for %s from now on",
                    worker,
                    error.message,
                    error.message,
                )
            self.paths[worker] = error.message

    def barred(self, worker: str) -> bool:
        """Quarantined or banned: nothing it sends is used."""
        return self.trust.barred(worker)

    def judge(
        self,
        worker: str,
        y: torch.Tensor,
        dtype: str,
        recompute: Callable[[], torch.Tensor],
        sid: str = "",
    ) -> tuple[torch.Tensor, Verdict]:
        """The tensor to use in place of remote result `y` ([R, H]) of `worker` for slice
        `sid`, and why."""
        self.stats.remote_rows += int(y.shape[0])
        if not finite(y):
            self.stats.nonfinite_results += 1
            self.caught(worker, "its result holds NaN or infinity")
            return recompute(), Verdict.REJECTED
        if self.mode == "off" or (self.mode == "sampled" and not self.trust.should_check(worker)):
            return y, Verdict.USED
        if self.exact_for(worker):  # a tolerance path: checked against exact float32
            with kernels.float32_activations():
                ref = recompute()
            return ref, self.check(worker, y, dtype, ref, "float32", sid)
        ref = recompute()
        return ref, self.check(worker, y, dtype, ref, sid=sid)

    def unchecked(self, worker: str, y: torch.Tensor, dtype: str) -> Verdict:
        """Remote result `y` of a slice this coordinator holds no experts of (a backbone file):
        nothing can recompute it here, so it is used as it is (USED) unless it is non-finite
        or labelled with a path this coordinator did not ask for (REJECTED: caught). Whether
        another holder of the slice confirms it first is `wants_witness` (`LayerCall`)."""
        self.stats.remote_rows += int(y.shape[0])
        if not finite(y):
            self.stats.nonfinite_results += 1
            self.caught(worker, "its result holds NaN or infinity")
            return Verdict.REJECTED
        if dtype != self.asked(worker):
            self.caught(worker, f"a {dtype} result for a job asking {self.asked(worker)}")
            return Verdict.REJECTED
        return Verdict.USED

    def wants_witness(self, worker: str) -> bool:
        """Whether a coordinator without experts has `worker`'s result confirmed by another
        holder of the slice before using it: the same draw as a recomputation would be
        (`KVQ_VERIFY_REMOTE`, the trust schedule)."""
        if self.mode == "off":
            return False
        return self.mode == "all" or self.trust.should_check(worker)

    def agree(self, a: Answer, b: Answer, exact: bool = True) -> bool:
        """Whether two workers' answers to the same rows agree: bit for bit on a
        deterministic path (both `q8` or both `f32cpu`: `check.BITWISE_PATHS`), else within
        the looser path's tolerances (`kvq.coordinator.check`), a GPU label counting only for
        an admitted worker (`held_to`). `exact` False (stage answers): bit for bit only where
        both carry one `numerics` label (`kvq.device.numerics`), else float32's tolerance,
        since a span's norms and softmax are torch float32 reductions whose order depends on
        the CPU's vector width: honest holders on two kinds of CPU differ in the last bits."""
        da, db = self.held_to(a.worker, a.dtype), self.held_to(b.worker, b.dtype)
        if deterministic(da, db):
            if exact or (a.numerics != "" and a.numerics == b.numerics):
                return torch.equal(a.y, b.y)
            da = db = "float32"
        return compare(a.y, b.y, tolerance(da, db), bias_tolerance(da, db)).ok

    def held_to(self, worker: str, dtype: str) -> str:
        """The path whose tolerance `worker`'s answer labelled `dtype` is held to: a GPU dtype
        only where the operator admitted the worker (`KVQ_GPU_WORKERS`), else float32's."""
        return dtype if dtype not in NEGOTIABLE or self.gpu_admitted(worker) else "float32"

    def confirmed(self, answers: list[Answer]) -> None:
        """Answers that agreed: each worker's streak grows as after a recomputation."""
        self.stats.verified += 1
        self.stats.verified_rows += int(answers[0].y.shape[0])
        for a in answers:
            self.trust.passed(a.worker)

    def outvoted(self, liar: Answer, by: list[Answer]) -> None:
        """`liar` disagreed with `by`, who agree with each other: caught."""
        self.stats.mismatches += 1
        self.caught(
            liar.worker,
            f"its {liar.dtype} result disagreed with those of "
            f"{', '.join(a.worker for a in by)} for the same job",
        )

    def exact_for(self, worker: str) -> bool:
        """Whether `worker`'s results are checked against float32 activations: its path is
        not this coordinator's deterministic one."""
        return self.local_dtype == "q8" and not deterministic(self.asked(worker), "q8")

    def check(
        self,
        worker: str,
        y: torch.Tensor,
        dtype: str,
        ref: torch.Tensor,
        ref_dtype: str | None = None,
        sid: str = "",
    ) -> Verdict:
        """Compare `y` with `ref`, this coordinator's recomputation in `ref_dtype` (None: its
        own path) of slice `sid`; record the outcome. A mismatch is charged to `worker` only
        once this coordinator's own bytes of the slice are known intact (else ModelCorrupt)."""
        st = self.stats
        local = self.local_dtype if ref_dtype is None else ref_dtype
        want = self.asked(worker)
        if dtype != want:  # the coordinator decides how results are checked, not the worker
            st.verified += 1
            st.mismatches += 1
            self.caught(worker, f"a {dtype} result for a job asking {want}")
            return Verdict.REJECTED
        tol = tolerance(dtype, local)
        c: Comparison = compare(y, ref, tol, bias_tolerance(dtype, local))
        st.verified += 1
        st.verified_rows += int(ref.shape[0])
        if c.finite and c.abs_err != float("inf"):
            st.max_abs_err = max(st.max_abs_err, c.abs_err)
        if c.ok and tol != 0.0 and (why := self._drift(worker, c, dtype)):
            st.mismatches += 1
            self.caught(worker, why)
            return Verdict.REJECTED
        if c.ok:
            self.trust.passed(worker)
            return Verdict.VERIFIED
        if sid:
            self.own_bytes(sid)  # raises ModelCorrupt: the fault is here, not the worker's
        st.mismatches += 1
        self.biases.pop(worker, None)
        self.errors.pop(worker, None)
        if not c.finite:
            why = "non-finite values"
        elif tol == 0.0:
            why = f"not bit-exact (relative row error {c.rel_err:.3g}, bias {c.bias:.3g})"
        else:
            why = f"relative row error {c.rel_err:.3g}, bias {c.bias:.3g} (tolerance {tol:g})"
        self.caught(worker, f"{why} ({dtype} result)")
        return Verdict.REJECTED

    def _drift(self, worker: str, c: Comparison, dtype: str) -> str:
        """Why the means over `worker`'s last `BIAS_WINDOW` checked results (each within the
        one-job tolerances) are not honest rounding: a steady scale (mean signed bias) or
        steady noise (mean relative row error); "" if they are."""
        biases = self.biases.setdefault(worker, [])
        errors = self.errors.setdefault(worker, [])
        biases.append(c.bias)
        errors.append(c.rel_err)
        del biases[:-BIAS_WINDOW], errors[:-BIAS_WINDOW]
        if len(biases) < BIAS_WINDOW:
            return ""
        bias, err = sum(biases) / len(biases), sum(errors) / len(errors)
        why = ""
        if abs(bias) > MEAN_BIAS_TOLERANCE.get(dtype, 4e-3):
            why = f"mean bias {bias:.3g}"
        elif err > MEAN_ROW_TOLERANCE.get(dtype, 1e-2):
            why = f"mean relative row error {err:.3g}"
        if why:
            self.biases.pop(worker, None)
            self.errors.pop(worker, None)
            why += f" over its last {BIAS_WINDOW} checked results ({dtype} results)"
        return why

    def caught(self, worker: str, reason: str) -> None:
        """Quarantine `worker` here and on the board (every coordinator of the model)."""
        verdict = self.trust.failed(worker, reason)
        self.stats.quarantines += 1
        self.board.quarantine(self.model, worker, verdict)
        log.warning(
            "worker %s returned a wrong result (%s): %s for %.0f s (mismatch %d)",
            worker,
            reason,
            "banned" if verdict.banned else "quarantined",
            self.trust.policy.quarantine_s,
            verdict.mismatches,
        )
        self.on_caught(worker)


def admitted(spec: str) -> Callable[[str], bool]:
    """Whether a worker id is in `KVQ_GPU_WORKERS` (`spec`: comma-separated ids, or `*`)."""
    ids = {w.strip() for w in spec.split(",") if w.strip()}
    return lambda worker: "*" in ids or worker in ids
