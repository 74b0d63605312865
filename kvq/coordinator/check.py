"""Does a remote result agree with the coordinator's own recomputation? The coordinator, not
the worker, says how it is checked.

Each job asks for a compute path (`wire.Job.want_dtype`): the coordinator's own (`q8`, int8
activations, the default on CPU; or `float32`), or, for a worker that cannot compute in it (a
CUDA worker), `bfloat16`/`float16` (`verify.Verifier.asked`). A result labelled otherwise is
refused and counted as a lie (`verify.Verifier.check`); the label never loosens a check.

- **`q8` against a `q8` coordinator: bitwise.** The int8 C kernels give the same bits on every
  SIMD path (scalar, AVX2, AVX2 + VNNI, AVX-512; `tests/quant/test_qdot.py`,
  `tests/coordinator/test_check_paths.py` forces two paths), every thread count and every batch
  a row is in, so an honest result equals the recomputation exactly: tolerance 0.
- **`f32cpu` against an `f32cpu` coordinator: bitwise.** Float32 activations on the CPU with
  batch-invariant products (`KVQ_BATCH_INVARIANT`, X17, `kvq.model.rowwise`): a row's bits do
  not depend on its batch, so an honest worker's result equals the recomputation when both
  run the same float32 code (torch's BLAS and vector functions pick their code by CPU: the
  same torch build on the same instruction set; a mixed swarm keeps `q8`, the default).
- **Paths that are not deterministic** (GPU bfloat16 and float16, float32 torch matmuls) are
  held to a tolerance derived from the measured spread of honest results for that path against
  the coordinator's float32 (10,000 random jobs, `tests/coordinator/test_check.py`), on two
  measures: the relative row error

    err = max_r ||y_r - ref_r|| / max(||ref_r||, mean_r ||ref_r||, 1e-30)

  (floored by the job's mean row norm, so a row whose experts cancel out is not held to a
  tolerance relative to almost nothing), and the job's scale bias

    bias = |<y - ref, ref>| / <ref, ref>

  which honest rounding leaves near 0 (it is unbiased) and a scaled answer y = (1 + e) ref sets
  to exactly e; and the mean signed bias of the worker's last `BIAS_WINDOW` checked results,
  which averages honest rounding out and keeps a steady lie. Measured over 3,000 honest jobs
  of 1-8 rows (`tests/coordinator/test_check.py`; hidden 256, and 64 as the tiny test models
  have): bfloat16 row 0.0096, bias std 1.0-1.3e-3, worst 0.0054-0.0070 (Q4_K at hidden 64);
  float16 row 0.0059, bias std 1.2-1.6e-4, worst 5.3-7.7e-4. The one-job tolerances
  (`ROW_TOLERANCE`, `BIAS_TOLERANCE`) keep about 2x over that worst, so a 5% lie fails on
  its first checked job; a 1% lie in bfloat16 hides inside one job's spread but not inside the
  mean of `BIAS_WINDOW` = 8 (honest std about 4.5e-4 there, 11 of them below the 5e-3 bound;
  a 1% lie's mean is 0.01): x1.01 is caught within 8 checked results, x1.05 at once.
A liar can still hide noise smaller than the row tolerance on a non-deterministic path: the
limit of any check by recomputation in another precision (`docs/security.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# relative row error an honest worker of this compute dtype may show against float32 (2-3x the
# worst measured: bfloat16 0.0096 at hidden 256, 0.0124 at 64; float16 0.0059); epsilons:
# float32 1.2e-7, float16 4.9e-4, bfloat16 3.9e-3. `q8` against float32 (0.15, 5.4x the worst measured) is what int8 costs, not
# a check: a q8 result is only accepted by a q8 coordinator, bit for bit (`tolerance`).
ROW_TOLERANCE = {"float32": 1e-3, "f32cpu": 1e-3, "float16": 1.2e-2, "bfloat16": 3e-2, "q8": 0.15}
# |<y - ref, ref>| / <ref, ref> an honest result may show in one job (2x the worst measured)
BIAS_TOLERANCE = {"float32": 1e-4, "f32cpu": 1e-4, "float16": 2e-3, "bfloat16": 1.5e-2, "q8": 0.02}
# the mean signed bias of a worker's last `BIAS_WINDOW` checked results: honest rounding
# averages out, a steady 1% lie stays at 1% (bfloat16's 1% lie can hide under one job's spread)
BIAS_WINDOW = 8
MEAN_BIAS_TOLERANCE = {
    "float32": 2e-5,
    "f32cpu": 2e-5,
    "float16": 1e-3,
    "bfloat16": 5e-3,
    "q8": 0.01,
}
# the mean relative row error of a worker's last `BIAS_WINDOW` checked results: honest rounding
# has a steady size (3,000 jobs per model, hidden 64 and 256, BF16 and Q4_K weights: bfloat16
# per job 0.0055-0.0063 on average, worst mean of 8 consecutive 0.0069; float16 0.0007, worst
# mean 0.0008), while noise added to a result, even orthogonal to each row (no bias to see),
# adds its size: a worker claiming a GPU path cannot hide 1.5% of noise under its 3% row
# tolerance for more than a window (`tests/coordinator/test_check.py`)
MEAN_ROW_TOLERANCE = {
    "float32": 2e-4,
    "f32cpu": 2e-4,
    "float16": 2.5e-3,
    "bfloat16": 1e-2,
    "q8": 0.15,
}
BITWISE = 0.0  # the tolerance of a deterministic path
_FALLBACK = "bfloat16"  # an unknown name (the wire refuses them) is not held to float32


# paths whose honest results are the same bits whatever the batch: the int8 C kernels (every
# SIMD path alike) and float32 with batch-invariant products on the CPU
BITWISE_PATHS = ("q8", "f32cpu")


def deterministic(remote: str, local: str) -> bool:
    """Whether an honest `remote` result equals `local`'s recomputation bit for bit: both
    on the same path of `BITWISE_PATHS`."""
    return remote == local and remote in BITWISE_PATHS


def tolerance(remote: str, local: str = "float32") -> float:
    """Allowed relative row error between a result computed in `remote` and one in `local`."""
    if deterministic(remote, local):
        return BITWISE
    return max(ROW_TOLERANCE.get(remote, ROW_TOLERANCE[_FALLBACK]), ROW_TOLERANCE.get(local, 0.0))


def bias_tolerance(remote: str, local: str = "float32") -> float:
    """Allowed scale bias between a result computed in `remote` and one in `local`."""
    if deterministic(remote, local):
        return BITWISE
    return max(
        BIAS_TOLERANCE.get(remote, BIAS_TOLERANCE[_FALLBACK]), BIAS_TOLERANCE.get(local, 0.0)
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of one check: `ok`, the relative row error, the largest absolute one and
    the (signed) scale bias."""

    ok: bool
    finite: bool
    rel_err: float
    abs_err: float
    bias: float = 0.0


def compare(
    y: torch.Tensor, ref: torch.Tensor, tol: float, bias_tol: float | None = None
) -> Comparison:
    """`y` (remote, [R, H]) against `ref` (local, [R, H]); non-finite `y` never agrees.
    `tol` 0 (`BITWISE`): equal bits or nothing. `bias_tol` None: the row error alone."""
    if y.shape != ref.shape:
        return Comparison(False, True, float("inf"), float("inf"), float("inf"))
    if not y.numel():
        return Comparison(True, True, 0.0, 0.0)
    y32, r32 = y.float(), ref.float()
    if not bool(torch.isfinite(y32).all()):
        return Comparison(False, False, float("inf"), float("inf"), float("inf"))
    diff = y32 - r32  # [R, H]
    norms = r32.norm(dim=1)  # [R]
    scale = torch.clamp(norms, min=max(float(norms.mean()), 1e-30))  # [R]
    rel = float((diff.norm(dim=1) / scale).max())
    d64, r64 = diff.double(), r32.double()
    bias = float((d64 * r64).sum() / max(float((r64 * r64).sum()), 1e-300))  # signed
    if tol == BITWISE:
        ok = torch.equal(y32, r32)
    else:
        ok = rel <= tol and (bias_tol is None or abs(bias) <= bias_tol)
    return Comparison(ok, True, rel, float(diff.abs().max()), bias)


def finite(y: torch.Tensor) -> bool:
    return bool(torch.isfinite(y).all())
