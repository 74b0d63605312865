"""Which torch device and dtype a node computes with (CUDA when present, CPU otherwise)."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable

import torch
from gguf import GGMLQuantizationType


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def compute_dtype(
    device: torch.device, setting: str = "auto", stored: Iterable[int] = ()
) -> torch.dtype:
    """The dtype experts compute in, by the precision rule: never below what they are stored
    in unless `setting` (`KVQ_COMPUTE_DTYPE`) asks for it. `auto`: float32, except on CUDA for
    weights stored all in F16 (float16) or all in BF16 (bfloat16). A quantized value
    (d * scale * q) needs float32 to be exact; a CPU computes float32 fastest anyway."""
    if setting != "auto":
        return _DTYPES[setting]
    types = {GGMLQuantizationType(t) for t in stored}
    if device.type == "cuda" and types == {GGMLQuantizationType.F16}:
        return torch.float16
    if device.type == "cuda" and types == {GGMLQuantizationType.BF16}:
        return torch.bfloat16
    return torch.float32


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, device: torch.device | str) -> str:
    """The name of the path a node computes on (results carry it: `wire.Result.dtype`):
    `KVQ_COMPUTE_DTYPE`'s name of the dtype, except on the CPU in float32: `q8` with int8
    activations (`KVQ_ACTIVATIONS=int8` and its kernel built), `f32cpu` with float32
    activations and batch-invariant products (`KVQ_BATCH_INVARIANT`, `kvq.model.rowwise`).
    Both give a row the same bits whatever its batch: checked bit for bit
    (`kvq.coordinator.check.deterministic`)."""
    from kvq.quant import kernels, qdot

    if dtype == torch.float32 and torch.device(device).type == "cpu":
        if kernels.int8_active():
            return "q8"
        if qdot.options().batch_invariant:
            return "f32cpu"
    return _NAMES.get(dtype, "float32")


def numerics(path: str) -> str:
    """What fixes the bits of a whole layer span computed on `path` (`dtype_name`), beyond the
    kernels: "" where nothing does (a GPU, bfloat16, float32 products that depend on the
    batch), else the machine, kvq, torch and the vector width torch's own CPU kernels
    dispatch to (`ATEN_CPU_CAPABILITY`), and the CPU's vendor and extensions (what the float32
    products' math library, MKL, dispatches on, with any `MKL_CBWR`-type override). kvq's kernels give the same bits on every SIMD
    path; torch's norms and softmax reduce in an order set by that width, not by the thread
    count.
    Two holders with one label give a span the same bits (stage answers are compared bit for
    bit then: `kvq.coordinator.verify.Verifier.agree`)."""
    from kvq import __version__
    from kvq.machine import cpu_kind, mkl_overrides
    from kvq.quant import qdot

    if path not in ("q8", "f32cpu") or not qdot.options().batch_invariant:
        return ""
    width = torch.backends.cpu.get_cpu_capability()
    mkl = mkl_overrides()
    parts = [platform.machine(), cpu_kind(), f"kvq-{__version__}", f"torch-{torch.__version__}"]
    return " ".join([*parts, *mkl, width])


def timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of `fn`, synchronizing the device around it (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
