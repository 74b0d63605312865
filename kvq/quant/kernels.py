"""Matrix products straight from GGUF-encoded weights on the CPU: `y = x @ W.T` without
dequantizing W first.

A decode step multiplies a handful of rows by each weight matrix, so the cost is reading and
unpacking the weights. Dequantizing a whole encoded matrix into float32 writes and reads 8x
more bytes than the encoding (`kvq.quant.dequantize`: about 3 ms for a 2048x1024 Q4_K matrix
on two cores); these kernels read the encoded bytes once (about 0.2 ms at one row, 0.5 ms at 8).

The float32 kernels (`kvq.quant.fused`, numba), two per type: one row, and two rows or
more sharing each weight row's unpacking (8 rows cost about 2.5x one row instead of 8x).
Activations and accumulation are float32 (the precision rule: nothing is computed at lower
precision than it is stored); each output is computed by one thread in a fixed order, so a
kernel's result does not depend on the thread count.

Threads: numba's parallel loops (`prange`) over output rows, as many threads as torch uses.
numba's default threading layer does not allow two parallel launches at once, so calls take a
process-wide lock; the kernel already uses every core.

int8 activations (`KVQ_ACTIVATIONS=int8`, the default; `configure`): every call of the types
it covers, of any number of rows, goes through the C kernel of `kvq.quant.qdot` instead, which
quantizes x to 8 bits per block and multiplies integers, as llama.cpp does, unpacking each
weight block once per 8 rows of x, or, on a CPU with AVX512BW + VNNI, from 2 to 12 rows by type
(`gemm_min` in `csrc/qdot_gemm.h`), once per tile of 16 weight rows and 128 rows of x
(`csrc/qdot_gemm.h`; 16 rows at a time through the AMX tiles where the CPU has them): no matrix is ever
dequantized, and each row gets the bits it gets alone, on every SIMD path. Below the stored
precision (errors in docs/models.md), so `KVQ_ACTIVATIONS=float32` keeps the exact path
(which dequantizes a matrix per call above `_MAX_ROWS` rows). A MoE layer's routed experts
are one C call (`moe_int8`, `moe_int8_batch`).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType

from kvq.quant import fused, qdot

Q = GGMLQuantizationType
MAX_ROWS = 64  # float32 activations: above this many rows (fewer for some), dequantize + matmul
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

_KERNELS = fused.ONE_ROW
# rows up to which the float32 kernels beat dequantize + matmul (`kvq bench kernels --batches 1,8,32,64`,
# 2048x1024, 2 AVX2 cores: at 64 rows Q8_0 and Q4_0 break even, the K-quants still win 1.2-2x)
_MAX_ROWS = {
    Q.Q8_0: 32,
    Q.Q4_0: 32,
    Q.Q5_0: 32,
    Q.Q4_K: MAX_ROWS,
    Q.Q5_K: MAX_ROWS,
    Q.Q6_K: MAX_ROWS,
    Q.MXFP4: 32,
}
KERNEL_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_KERNELS)
_lock = threading.Lock()
_int8_for: tuple[qdot.KernelOptions, qdot.Built | None] | None = None  # options -> kernel
_MAX_THREADS: int = getattr(numba.config, "NUMBA_NUM_THREADS", 1)  # numba's pool size


def keeps_encoded(qtype: int, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a matrix of `qtype` computes fastest encoded here (a kernel covers it)."""
    return qtype in _KERNELS and torch.device(device).type == "cpu" and dtype == torch.float32


def covers(qtype: int, rows: int, x: torch.Tensor) -> bool:
    """Whether `matmul` has a kernel for `rows` rows of x (CPU, float32) times `qtype`: the
    int8 kernel for any number of rows (a prompt's included: many rows take its tile kernel),
    the float32 kernels up to `_MAX_ROWS`."""
    if qtype not in _KERNELS or rows <= 0 or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    return rows <= _MAX_ROWS[qtype] or (qtype in qdot.TYPES and int8_kernel() is not None)


_exact = threading.local()  # `on`: this thread computes with float32 activations for now


class float32_activations:  # used as a function: `with float32_activations():`
    """This thread's products use float32 activations inside the block, whatever
    `KVQ_ACTIVATIONS` says: a coordinator checking a worker's bfloat16 result recomputes it
    exactly (`kvq.coordinator.verify`)."""

    def __enter__(self) -> None:
        self.before = getattr(_exact, "on", False)
        _exact.on = True

    def __exit__(self, *_exc: object) -> None:
        _exact.on = self.before


def int8_kernel() -> qdot.Built | None:
    """The C kernel when int8 activations are asked for and it could be built, else None
    (the first call builds it, or warns once that it cannot and the float32 kernels stay)."""
    global _int8_for
    if getattr(_exact, "on", False):
        return None
    o = qdot.options()
    last = _int8_for
    if last is not None and last[0] is o:  # every decode matmul asks: keep it cheap
        return last[1]
    built = None
    if o.activations == "int8":
        built = qdot.load_configured(o)
    _int8_for = (o, built)
    return built


def paths() -> dict[str, str]:
    """What this process multiplies quantized matrices with, for reports: the activations,
    the int8 kernel's instruction-set path (as asked for, lowered to what the CPU has) and
    what computes calls of many rows (a prompt)."""
    built = int8_kernel()
    if built is None:
        return {
            "activations": "float32",
            "int8_isa": "",
            "many_rows": f"dequantize + torch matmul above {MAX_ROWS} rows",
        }
    isa = built.isa(qdot.options().isa)
    return {"activations": "int8", "int8_isa": isa, "many_rows": qdot.many_rows_kernel(isa)}


def describe(device: str = "cpu") -> str:
    """One line for reports and a worker's `info`: what multiplies quantized matrices on
    `device` (a torch device type) and where its kernel came from, e.g. `int8 avx512
    (installed)`, `int8 avx2 (built at first use)`, `float32 (KVQ_ACTIVATIONS)`, `float32 (no
    int8 kernel: none installed, no compiler)`, or `torch on cuda` off the CPU. Loads the
    kernel if nothing has yet."""
    if device != "cpu":
        return f"torch on {device}"
    built = int8_kernel()
    if built is not None:
        return f"int8 {built.isa(qdot.options().isa)} ({built.origin})"
    if qdot.options().activations == "float32":
        return "float32 (KVQ_ACTIVATIONS)"
    return "float32 (no int8 kernel: none installed, no compiler)"


def int8_active() -> bool:
    """Whether products of the quantized types use int8 activations here."""
    return int8_kernel() is not None


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [B, K] float32 @ W.T for W [N, K] encoded as `raw` (uint8 [N, row bytes] of qtype).
    Returns [B, N] float32. The caller checks `covers` and the shapes."""
    xa = np.ascontiguousarray(x.detach().numpy())
    wa = np.ascontiguousarray(raw.numpy())
    threads = max(1, torch.get_num_threads())
    if qtype in qdot.TYPES:
        built = int8_kernel()
        if built is not None:
            return torch.from_numpy(qdot.matmul(built, xa, wa, qtype, threads, qdot.options().isa))
    return torch.from_numpy(_float32(xa, wa, qtype, threads))


def matmul_one(x: torch.Tensor, weights: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """One row x [1, K] float32 @ W.T for each W [N, K] encoded as (raw, qtype) (uint8 [N,
    row bytes], C-contiguous) in one C call: `matmul`'s bits for each, one parallel region
    for all (a decode step's q, k and v). Returns [1, N] float32 each. The caller checks
    `one_covers`."""
    built = int8_kernel()
    assert built is not None, "matmul_one without one_covers"
    xc = x.detach().contiguous()
    outs = [torch.empty((1, int(raw.shape[0])), dtype=torch.float32) for raw, _ in weights]
    mats = [(raw.data_ptr(), int(raw.shape[0]), int(raw.shape[1]), int(q)) for raw, q in weights]
    threads = max(1, torch.get_num_threads())
    qdot.matmul_one(
        built,
        xc.data_ptr(),
        int(x.shape[1]),
        mats,
        [o.data_ptr() for o in outs],
        threads,
        qdot.options().isa,
    )
    return outs


def one_covers(qtypes: list[int], x: torch.Tensor) -> bool:
    """Whether `matmul_one` takes one row x times matrices of `qtypes` here (int8 kernel
    built, CPU float32 x, K a multiple of each type's block)."""
    if x.shape[0] != 1 or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if not 1 <= len(qtypes) <= 8 or int8_kernel() is None:
        return False
    return all(q in _BLOCK and int(x.shape[1]) % _BLOCK[Q(q)] == 0 for q in qtypes)


_BLOCK = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.Q8_0: 32, Q.Q4_0: 32, Q.Q5_0: 32, Q.MXFP4: 32}


def moe_covers(types: tuple[int, int, int], h: int, f: int) -> bool:
    """Whether `moe_int8` computes experts of these gate, up and down types with hidden size
    `h` and expert FFN size `f` here (int8 activations asked for and built)."""
    if not all(t in _BLOCK for t in types) or int8_kernel() is None:
        return False
    gb, ub, db = (_BLOCK[Q(t)] for t in types)
    return h % gb == 0 and h % ub == 0 and f % db == 0


Biases = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None  # per expert: gate, up, down


def moe_int8(
    x: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    types: tuple[int, int, int],
    weights: list[float],
    oai: bool = False,
    biases: Biases = None,
) -> torch.Tensor:
    """One token's routed experts in one C call (`qdot.moe`, int8 activations):
    `sum_e weights[e] * down_e(silu(gate_e x) * up_e x)`, added in the order given. x: [H]
    float32; experts: the raw bytes (uint8 [rows, row bytes], C-contiguous, on the CPU) of
    each expert's gate [F, H], up [F, H] and down [H, F], all of `types`. Returns [H] float32.
    The caller checks `moe_covers`. `oai` and `biases` (float32, contiguous, on the CPU; one
    triple per expert): gpt-oss's `down_e(swiglu_oai(gate_e x + bg, up_e x + bu)) + bd`."""
    built, ptrs, rb, f, xa, threads = _moe_args(x, experts)
    wa = np.asarray(weights, dtype=np.float32)
    return torch.from_numpy(
        qdot.moe(
            built,
            xa,
            ptrs,
            types,
            rb,
            f,
            wa,
            threads,
            qdot.options().isa,
            act=int(oai),
            biases=_bias_ptrs(biases),
        )
    )


def moe_int8_batch(
    x: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    types: tuple[int, int, int],
    start: list[int],
    rows: list[int],
    weights: list[float],
    oai: bool = False,
    biases: Biases = None,
) -> torch.Tensor:
    """Several tokens' routed experts in one C call (`qdot.moe_batch`, int8 activations):
    row t is `sum weights[p] * down_e(silu(gate_e x[t]) * up_e x[t])` over the pairs p of token
    t, added in pair order, the same bits as `moe_int8` of x[t] with those experts. x: [T, H]
    float32; experts: as in `moe_int8`, each of them once; start: [n + 1], expert i takes pairs
    start[i] .. start[i + 1] - 1; rows, weights: [M], each pair's token row and weight.
    Returns [T, H] float32. The caller checks `moe_covers`. `oai`, `biases`: as `moe_int8`."""
    built, ptrs, rb, f, xa, threads = _moe_args(x, experts)
    return torch.from_numpy(
        qdot.moe_batch(
            built,
            xa,
            ptrs,
            np.asarray(start, np.int64),
            np.asarray(rows, np.int64),
            np.asarray(weights, np.float32),
            types,
            rb,
            f,
            threads,
            qdot.options().isa,
            act=int(oai),
            biases=_bias_ptrs(biases),
        )
    )


def _bias_ptrs(biases: Biases) -> list[tuple[int, int, int]] | None:
    if biases is None:
        return None
    for b in biases:
        if not all(
            t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in b
        ):
            raise ValueError("expert biases must be contiguous float32 CPU tensors")
    return [(g.data_ptr(), u.data_ptr(), d.data_ptr()) for g, u, d in biases]


def _moe_args(
    x: torch.Tensor, experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> tuple[qdot.Built, list[tuple[int, int, int]], tuple[int, int, int], int, F32, int]:
    """What both MoE calls pass the C kernel: the built kernel, each expert's gate/up/down
    addresses, their row bytes, the FFN size, x as numpy and the thread count."""
    built = int8_kernel()
    assert built is not None, "a MoE call without moe_covers"
    g0, u0, d0 = experts[0]  # the caller passes at least one expert
    rb = (int(g0.shape[1]), int(u0.shape[1]), int(d0.shape[1]))
    ptrs = [(g.data_ptr(), u.data_ptr(), d.data_ptr()) for g, u, d in experts]
    xa = np.ascontiguousarray(x.detach().numpy())
    return built, ptrs, rb, int(g0.shape[0]), xa, max(1, torch.get_num_threads())


def matmul_float32(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """`matmul` with float32 activations whatever `KVQ_ACTIVATIONS` says (benchmarks)."""
    xa = np.ascontiguousarray(x.detach().numpy())
    wa = np.ascontiguousarray(raw.numpy())
    return torch.from_numpy(_float32(xa, wa, qtype, max(1, torch.get_num_threads())))


def _float32(xa: F32, wa: U8, qtype: int, threads: int) -> F32:
    out = np.empty((xa.shape[0], wa.shape[0]), dtype=np.float32)
    torch_threads = torch.get_num_threads()
    threads = min(threads, _MAX_THREADS)
    with _lock:
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)
        if xa.shape[0] == 1:
            _KERNELS[qtype](wa, xa, out)
        else:
            fused.tiled(int(qtype), wa, xa, out)
    if torch.get_num_threads() != torch_threads:
        # numba's OpenMP pool, when it starts (the first call, or a recompile), sets the
        # process's OpenMP thread count to its own size (NUMBA_NUM_THREADS, default every
        # CPU), which torch shares: `OMP_NUM_THREADS=1 kvq coordinator` then ran 2 threads
        torch.set_num_threads(torch_threads)
    return out
