"""The int8-activation kernel (`csrc/qdot.c`): built with the system C compiler at first use,
loaded with ctypes.

`y = x @ W.T` for W in GGUF blocks (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, MXFP4) with x quantized to
8 bits per block (per 256 values for the K-quants, per 32 for the others), integer dot products
(vpmaddubsw with AVX2, vpdpbusd with AVX512-VNNI; on arm64 smull with NEON, sdot with the
dot-product extension, smmla with i8mm for calls of several rows) and one float32 combination
per block. From 16
rows of x on AVX512BW + VNNI (a prompt; `csrc/qdot_gemm.h`), a tile of 16 weight rows is
unpacked once into a cache-resident buffer and multiplied with 128 rows of x at a time, one
weight row per int32 lane; the same integers and float steps, so the same bits. At one row of x
(a decode step; `csrc/qdot_rows_z.h`) Q4_K and Q6_K go 8 weight rows at a time on AVX-512,
their blocks' sums reduced and combined in 8 float lanes, one per weight row, with the scalar
path's operations; `matmul_one` takes a decode step's q, k and v in one call. It
computes below the stored precision (the activations lose bits, as llama.cpp's do); it is the
default (`KVQ_ACTIVATIONS=int8`, `kvq.quant.kernels.configure`), and `KVQ_ACTIVATIONS=float32`
turns it off for the exact path.

The instruction set is chosen at run time by the C code (`__builtin_cpu_supports`; on arm64
the kernel's HWCAP bits through `getauxval`), never
assumed from the build machine; every path gives the same bits (the integers are exact and the
float part is shared), and each output is computed by one thread, so results depend neither on
the CPU's features nor on the thread count.

The same library carries the decode-attention kernel (`attn_decode`, `csrc/attn_decode.h`:
one decode step's attention of every sequence in one call), which is float32 and runs whatever
the activations setting says (`kvq.model.decode_attention`).

Where it comes from, in this order (`Built.origin` says which):
- **installed**: `pip install` compiled it with setuptools (`setup.py`) into
  `kvq/quant/_qdot*.so`, so a machine or image with no compiler at run time has it. It is used
  when the hash of the sources it was built from (`kvq_qdot_sources_key`) is the hash of the
  sources here (`sources_key`): an editable checkout whose C files changed since the install
  builds afresh instead of running a stale library.
- **built at first use**: `cc -O3 -shared -fPIC -ffp-contract=off -fno-math-errno -fopenmp
  qdot.c -lm` into a cache directory, named by the hash of the sources, the compiler and the
  flags; written to a temporary name and renamed into place, so processes building at once
  each end up loading a whole library.
Either way the flags are the same, so are the bits. The OpenMP runtime is libgomp.so.1, which
torch has already loaded: the kernel shares torch's threads. Without OpenMP (each build retries
without it) the kernel runs on one thread. Where neither exists, `load` logs one warning and
returns None, and the caller keeps the float32 numba kernels (`kernels.paths()` says so, and a
worker reports it in its `info`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
log = logging.getLogger("kvq.quant")

INSTALL_DIR = Path(__file__).resolve().parent  # where `pip install` puts _qdot*.so
CSRC = INSTALL_DIR / "csrc"
SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.[ch]")))  # every one is in the cache key
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-std=c11")
OPENMP = ("-fopenmp",)
TYPES: tuple[GGMLQuantizationType, ...] = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4)
# the C kernel's paths (csrc/qdot.c's ISA_*): x86's, then arm64's (csrc/qdot_arm.h)
ISA_NAMES = {
    0: "scalar",
    1: "avx2",
    2: "avx2+vnni",
    3: "avx512",
    4: "amx",
    5: "neon",
    6: "neon+dotprod",
    7: "neon+i8mm",
}
_ERRORS = {
    -1: "unknown type",
    -2: "columns not a multiple of the block",
    -3: "out of memory",
    -4: "pairs out of order or a row out of range",
}


INSTALLED, FIRST_USE = "installed", "built at first use"


@dataclass(frozen=True, slots=True)
class Built:
    """The loaded library, what it was built with and where it came from (`INSTALLED` or
    `FIRST_USE`)."""

    lib: ctypes.CDLL
    path: Path
    openmp: bool
    origin: str = FIRST_USE

    @property
    def best_isa(self) -> str:
        return ISA_NAMES[int(self.lib.kvq_qdot_best_isa())]

    def isa(self, asked: int = -1) -> str:
        """The path a call asking for `asked` runs (-1, or a path this CPU lacks: the best it
        has; the C code's own rule, `kvq_qdot_isa`)."""
        return ISA_NAMES[int(self.lib.kvq_qdot_isa(asked))]

    def paths(self) -> tuple[int, ...]:
        """The ids of the paths this CPU runs, scalar first (each runs as asked)."""
        return tuple(i for i in ISA_NAMES if int(self.lib.kvq_qdot_isa(i)) == i)


def many_rows_kernel(isa: str) -> str:
    """What computes a call of several rows on path `isa`: from gemm_min(type) rows (2 for
    the 32-value types, 4 to 12 for the K-quants) `csrc/qdot_gemm.h` on AVX-512, the
    multi-row dots elsewhere (on i8mm two weight rows at a time); with AMX, 16 rows of x at a
    time through its tiles (not Q6_K)."""
    if isa == "avx512":
        return "tile: 16 weight rows unpacked once per 128 rows (AVX512BW + VNNI)"
    if isa == "amx":
        return "tile: 16 weight rows unpacked once per 128 rows; AMX TDPBSUD for 16 rows of x at a time, VNNI for the rest and Q6_K"
    if isa == "neon+i8mm":
        return "multi-row dots, two weight rows at once (smmla): each unpacked once per 8 rows"
    return "multi-row dots: each weight row unpacked once per 8 rows"


def default_cache_dir(state_dir: str = "") -> Path:
    """`<KVQ_STATE_DIR>/kernels` when that is set, else `~/.cache/kvq/kernels`."""
    if state_dir:
        return Path(state_dir).expanduser() / "kernels"
    return Path.home() / ".cache" / "kvq" / "kernels"


def sources_key() -> str:
    """sha256 over the C sources in name order (`setup.py` computes the same at install)."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def _key(cc: str, flags: tuple[str, ...]) -> str:
    """The name of a build at first use: the sources, the compiler and the flags."""
    return hashlib.sha256("\0".join((sources_key(), cc, *flags)).encode()).hexdigest()[:16]


def installed() -> Built | None:
    """The library `pip install` built beside this module, where there is one built from
    these very sources; None otherwise (no compiler at install, or C files changed since)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = INSTALL_DIR / f"_qdot{suffix}"
        if not path.is_file():
            continue
        lib = ctypes.CDLL(str(path))
        stamp = getattr(lib, "kvq_qdot_sources_key", None)
        if stamp is not None:
            stamp.restype = ctypes.c_char_p
        if stamp is None or stamp().decode() != sources_key():
            log.info("%s was built from other sources than these; building them instead", path)
            return None
        _declare(lib)
        return Built(lib, path, bool(lib.kvq_qdot_openmp()), INSTALLED)
    return None


def _compile(cc: str, flags: tuple[str, ...], dest: Path) -> str | None:
    """Build into `dest` (atomically); None, or why it failed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, str(CSRC / "qdot.c"), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            return f"{' '.join(cmd)} exited {proc.returncode}: {lines[-1] if lines else ''}"
        os.replace(tmp, dest)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc}: {exc}"
    finally:
        with contextlib.suppress(FileNotFoundError):  # renamed into place, or not
            os.unlink(tmp)


def build(cc: str, cache_dir: Path) -> Built:
    """Build (or find in `cache_dir`) and load the library; OSError or RuntimeError on
    failure. With OpenMP first, then without."""
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set CC)")
    why = ""
    for flags, openmp in (((*FLAGS, *OPENMP), True), (FLAGS, False)):
        path = cache_dir / f"qdot-{_key(cc, flags)}.so"
        if not os.path.isfile(path):
            err = _compile(cc, flags, path)
            if err is not None:
                why = err
                continue
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        return Built(lib, path, openmp, FIRST_USE)
    raise RuntimeError(why)


# each exported C function's arguments, one letter an argument (i int, L int64_t, p pointer,
# f float) as csrc/qdot.c declares them; every one returns an int (and kvq_qdot_sources_key,
# declared apart, a string)
_SIGNATURES = {
    "kvq_qdot": "i p L L p L L p i i",
    "kvq_qdot_moe": "i p p p p p L L p p p i i i p",
    "kvq_qdot_one": "i p p p p p L p i i",
    "kvq_stream_read": "p L i",
    "kvq_qdot_moe_batch": "i p p p p p L L L p p p p p i i i p",
    "kvq_attn_decode": "L L L L p p p p p p f p p i",
    "kvq_qdot_best_isa": "",
    "kvq_qdot_isa": "i",
    "kvq_qdot_openmp": "",
}
_CTYPES = {"i": ctypes.c_int, "L": ctypes.c_int64, "p": ctypes.c_void_p, "f": ctypes.c_float}


def _declare(lib: ctypes.CDLL) -> None:
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[a] for a in args.split()]
        fn.restype = ctypes.c_int
    lib.kvq_qdot_sources_key.argtypes = []
    lib.kvq_qdot_sources_key.restype = ctypes.c_char_p


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """How this process's kernels compute; set once at the entry point (`configure`).

    `activations`: `int8` (the default, KVQ_ACTIVATIONS: through the C kernel, what llama.cpp
    does) or `float32` (the exact path: the numba kernels of `kvq.quant.fused`). `isa`: the
    SIMD path of the C kernel, -1 the best this CPU has (tests force one; every path gives the
    same bits). `cc`: the C compiler that builds it
    (the CC environment variable). `cache_dir`: where the built library is kept ("" =
    `qdot.default_cache_dir()`). `batch_invariant` (KVQ_BATCH_INVARIANT): float32 products on
    the CPU give each row its bits alone (`kvq.model.rowwise`, X17)."""

    activations: str = "int8"
    cc: str = "cc"
    cache_dir: str = ""
    isa: int = -1
    batch_invariant: bool = True


_options = KernelOptions()


def configure(options: KernelOptions) -> None:
    """Set the process-wide kernel options (the CLI does, from the settings)."""
    global _options
    if options.activations not in ("float32", "int8"):
        raise ValueError(f"activations {options.activations!r}: want float32 or int8")
    _options = options


def options() -> KernelOptions:
    return _options


_lock = threading.Lock()
_loaded: dict[tuple[str, str], Built | None] = {}


def load(cc: str = "cc", cache_dir: Path | None = None) -> Built | None:
    """The installed library where it matches these sources, else the one built at the first
    call per (compiler, directory); None (after one warning) where neither can be had."""
    d = cache_dir or default_cache_dir()
    key = (cc, str(d))
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = installed() or build(cc, d)
            except (OSError, RuntimeError) as exc:
                log.warning(
                    "the int8-activation kernel could not be built (%s); computing with the "
                    "float32 kernels instead (KVQ_ACTIVATIONS=int8 has no effect)",
                    exc,
                )
                _loaded[key] = None
        return _loaded[key]


def load_configured(o: KernelOptions | None = None) -> Built | None:
    """The library with the compiler and cache directory that `o` names (default: this
    process's `options()`), as `load` gives it."""
    o = o or _options
    return load(o.cc, Path(o.cache_dir) if o.cache_dir else None)


def matmul(
    built: Built,
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.uint8],
    qtype: int,
    threads: int,
    isa: int = -1,
) -> npt.NDArray[np.float32]:
    """x [B, K] float32 (C-contiguous) @ W.T for W [N, row bytes] of `qtype` -> [B, N].
    `isa`: -1 the best this CPU has, 0 scalar, 1 AVX2, 2 AVX2 + VNNI, 3 AVX512BW + VNNI (512-bit
    Q4_K and Q6_K), 4 AMX, 5 NEON, 6 NEON + sdot, 7 NEON + sdot + smmla (`ISA_NAMES`); a path
    the CPU lacks runs its best."""
    n, b, k = w.shape[0], x.shape[0], x.shape[1]
    out = np.empty((b, n), dtype=np.float32)
    rc = built.lib.kvq_qdot(
        int(qtype),
        w.ctypes.data,
        n,
        w.shape[1],
        x.ctypes.data,
        b,
        k,
        out.ctypes.data,
        threads,
        isa,
    )
    if rc != 0:
        raise ValueError(f"qdot {Q(qtype).name} [{n}, {k}]: {_ERRORS.get(rc, rc)}")
    return out


def matmul_one(
    built: Built,
    x: int,
    k: int,
    mats: list[tuple[int, int, int, int]],
    outs: list[int],
    threads: int,
    isa: int = -1,
) -> None:
    """One row of x against several matrices in one call (`csrc/qdot_rows.h`): the bits of
    one `matmul` per matrix, one quantization of x per kind of block, one parallel region.
    x: the address of [k] float32; mats: per matrix (address, rows, row bytes, ggml type) of
    its C-contiguous bytes; outs: per matrix the address of its [rows] float32 output."""
    n = len(mats)
    rc = built.lib.kvq_qdot_one(
        n,
        (ctypes.c_int * n)(*(m[3] for m in mats)),
        (ctypes.c_void_p * n)(*(m[0] for m in mats)),
        (ctypes.c_int64 * n)(*(m[1] for m in mats)),
        (ctypes.c_int64 * n)(*(m[2] for m in mats)),
        x,
        k,
        (ctypes.c_void_p * n)(*outs),
        threads,
        isa,
    )
    if rc != 0:
        names = ", ".join(Q(m[3]).name for m in mats)
        raise ValueError(f"qdot of one row against {names} (k {k}): {_ERRORS.get(rc, rc)}")


def moe(
    built: Built,
    x: npt.NDArray[np.float32],
    experts: list[tuple[int, int, int]],
    types: tuple[int, int, int],
    row_bytes: tuple[int, int, int],
    f: int,
    weights: npt.NDArray[np.float32],
    threads: int,
    isa: int = -1,
    act: int = 0,
    biases: list[tuple[int, int, int]] | None = None,
) -> npt.NDArray[np.float32]:
    """One token's routed experts in one call (`csrc/qdot_moe.h`): the sum over experts e of
    `weights[e] * down_e(silu(gate_e x) * up_e x)`, added in the order given; with `act` 1 and
    `biases` (per expert the addresses of its float32 gate [f], up [f] and down [H] biases)
    gpt-oss's `down_e(swiglu_oai(gate_e x + bg, up_e x + bu)) + bd`.

    x: [H] float32 (C-contiguous); experts: per expert the addresses of its gate [f, H], up
    [f, H] and down [H, f] bytes (C-contiguous, alive for the call); types and row_bytes: of
    gate, up and down; weights: [n] float32. Returns [H] float32. ValueError on a type it does
    not cover or a size that is not a multiple of a type's block."""
    n, h = len(experts), int(x.shape[0])
    gate, up, down = ((ctypes.c_void_p * max(n, 1))(*(e[j] for e in experts)) for j in range(3))
    out = np.empty(h, dtype=np.float32)
    rc = built.lib.kvq_qdot_moe(
        n,
        gate,
        up,
        down,
        (ctypes.c_int * 3)(*types),
        (ctypes.c_int64 * 3)(*row_bytes),
        f,
        h,
        x.ctypes.data,
        weights.ctypes.data,
        out.ctypes.data,
        threads,
        isa,
        act,
        _bias_ptrs(biases),
    )
    if rc != 0:
        names = "/".join(Q(t).name for t in types)
        raise ValueError(f"qdot moe {names} [{f}, {h}]: {_ERRORS.get(rc, rc)}")
    return out


def moe_batch(
    built: Built,
    x: npt.NDArray[np.float32],
    experts: list[tuple[int, int, int]],
    start: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32],
    types: tuple[int, int, int],
    row_bytes: tuple[int, int, int],
    f: int,
    threads: int,
    isa: int = -1,
    act: int = 0,
    biases: list[tuple[int, int, int]] | None = None,
) -> npt.NDArray[np.float32]:
    """A batch of tokens' routed experts in one call (`csrc/qdot_moe.h`): row t of the result
    is the sum over token t's pairs p, in order, of `weights[p] * down_e(silu(gate_e x[t]) *
    up_e x[t])`; each expert's weights are unpacked once for all of its tokens. Row t is the
    same bits as `moe` of x[t] with that token's experts in the same order.

    x: [T, H] float32 (C-contiguous); experts: n experts' addresses as in `moe`; start: [n + 1]
    int64, expert e takes pairs start[e] .. start[e + 1] - 1; rows: [M] int64 token row of
    each pair; weights: [M] float32. Returns [T, H] float32. ValueError as `moe`, or on pairs
    that do not fit (start not ascending from 0, a row outside [0, T)). `act`, `biases`: as in
    `moe`, per expert."""
    n, (t, h) = len(experts), x.shape
    start, rows = np.ascontiguousarray(start, np.int64), np.ascontiguousarray(rows, np.int64)
    weights = np.ascontiguousarray(weights, np.float32)
    if len(start) != n + 1 or (n and (start[-1] != len(rows) or len(rows) != len(weights))):
        raise ValueError(
            f"qdot moe_batch: start {len(start)} for {n} experts, rows {len(rows)}, "
            f"weights {len(weights)}"
        )
    gate, up, down = ((ctypes.c_void_p * max(n, 1))(*(e[j] for e in experts)) for j in range(3))
    out = np.empty((t, h), dtype=np.float32)
    rc = built.lib.kvq_qdot_moe_batch(
        n,
        gate,
        up,
        down,
        (ctypes.c_int * 3)(*types),
        (ctypes.c_int64 * 3)(*row_bytes),
        f,
        h,
        t,
        x.ctypes.data,
        start.ctypes.data,
        rows.ctypes.data,
        weights.ctypes.data,
        out.ctypes.data,
        threads,
        isa,
        act,
        _bias_ptrs(biases),
    )
    if rc != 0:
        names = "/".join(Q(ty).name for ty in types)
        raise ValueError(f"qdot moe_batch {names} [{f}, {h}]: {_ERRORS.get(rc, rc)}")
    return out


def _bias_ptrs(biases: list[tuple[int, int, int]] | None) -> ctypes.Array[ctypes.c_void_p] | None:
    """3n addresses (expert e's gate, up and down biases at 3e..3e + 2), or None (NULL)."""
    if biases is None:
        return None
    return (ctypes.c_void_p * max(3 * len(biases), 1))(*(a for b in biases for a in b))


def attn_decode(
    built: Built,
    q: int,
    knew: int,
    vnew: int,
    caches: list[tuple[int, int]],
    lens: list[int],
    heads: int,
    kv: int,
    d: int,
    scale: float,
    sinks: int,
    out: int,
    threads: int,
) -> None:
    """One decode step's attention of len(caches) sequences in one call (`csrc/attn_decode.h`):
    writes each sequence's new key and value into its cache at position lens[s], then
    out[s, h] = softmax(scale * q[s, h] . keys) @ values over positions 0 .. lens[s] of kv head
    h // (heads / kv), a sink's logit in the softmax where `sinks` is not 0.

    Addresses of float32 C-contiguous memory: q and out [S, heads, d], knew and vnew [S, kv,
    d], caches per sequence its layer's keys and values [capacity > lens[s], kv, d], sinks
    [heads] or 0. ValueError on sizes that do not fit."""
    n = len(caches)
    kc = (ctypes.c_void_p * max(n, 1))(*(c[0] for c in caches))
    vc = (ctypes.c_void_p * max(n, 1))(*(c[1] for c in caches))
    rc = built.lib.kvq_attn_decode(
        n,
        heads,
        kv,
        d,
        q,
        knew,
        vnew,
        kc,
        vc,
        (ctypes.c_int64 * max(n, 1))(*lens),
        scale,
        sinks or None,
        out,
        threads,
    )
    if rc != 0:
        why = {-2: "heads not a multiple of kv heads, or a size below 1", -3: "out of memory"}
        raise ValueError(
            f"attn_decode of {n} sequences, {heads}/{kv} heads of {d}: {why.get(rc, rc)}"
        )
