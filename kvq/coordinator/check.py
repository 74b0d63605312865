"""Does a remote result agree with the coordinator's own recomputation? Tolerance by dtype.

An honest worker computing in a lower precision (bfloat16 on CUDA) differs from the
coordinator's float32 result by rounding, never by more than a few units of that dtype's
epsilon relative to the row's size. The error is measured per row, relative to the row's norm
(floored by the job's mean row norm, so a row whose experts cancel out is not held to a
tolerance relative to almost nothing):

    err = max_r ||y_r - ref_r|| / max(||ref_r||, mean_r ||ref_r||, 1e-30)

and a result agrees when it is finite and `err <= tolerance(remote dtype, local dtype)`.
`ROW_TOLERANCE` is 6-7x the worst error measured over 10,000 random jobs of real kernels
(`tests/coordinator/test_check.py`: bfloat16 0.0096 on BF16 and Q4_K weights, float16 0.0059;
the test keeps a 4x margin); `q8` (float32 with int8 activations, `KVQ_ACTIVATIONS=int8`) is
5.4x its worst, 0.028 over single-row jobs of K-quant and Q8_0/Q4_0 experts, every expert call
then one row through the int8 kernel (`tests/quant/test_qdot.py`). Honest rounding stays well
below it, while wrong numbers (noise,
a scaled, shifted, negated or permuted answer, a row moved by a third of the job's scale) land
far above.
A liar can still hide an error smaller than the tolerance: that is the limit of any check by
recomputation in another precision (`docs/security.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# relative row error an honest worker of this compute dtype may show against float32;
# epsilons: float32 1.2e-7, float16 4.9e-4, bfloat16 3.9e-3
ROW_TOLERANCE = {"float32": 1e-3, "float16": 4e-2, "bfloat16": 6e-2, "q8": 0.15}
_FALLBACK = "bfloat16"  # an unknown name (the wire refuses them) is not held to float32


def tolerance(remote: str, local: str = "float32") -> float:
    """Allowed relative row error between a result computed in `remote` and one in `local`."""
    return max(ROW_TOLERANCE.get(remote, ROW_TOLERANCE[_FALLBACK]), ROW_TOLERANCE.get(local, 0.0))


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of one check: `ok`, the relative row error and the largest absolute one."""

    ok: bool
    finite: bool
    rel_err: float
    abs_err: float


def compare(y: torch.Tensor, ref: torch.Tensor, tol: float) -> Comparison:
    """`y` (remote, [R, H]) against `ref` (local, [R, H]); non-finite `y` never agrees."""
    if y.shape != ref.shape:
        return Comparison(False, True, float("inf"), float("inf"))
    if not y.numel():
        return Comparison(True, True, 0.0, 0.0)
    y32, r32 = y.float(), ref.float()
    if not bool(torch.isfinite(y32).all()):
        return Comparison(False, False, float("inf"), float("inf"))
    diff = y32 - r32  # [R, H]
    norms = r32.norm(dim=1)  # [R]
    scale = torch.clamp(norms, min=max(float(norms.mean()), 1e-30))  # [R]
    rel = float((diff.norm(dim=1) / scale).max())
    return Comparison(rel <= tol, True, rel, float(diff.abs().max()))


def finite(y: torch.Tensor) -> bool:
    return bool(torch.isfinite(y).all())
