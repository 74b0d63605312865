"""The many-row tile kernel (`csrc/qdot_gemm.h`, AVX512BW + VNNI, from `gemm_min(type)` rows of x,
2 to 12; with AMX, 16 rows of x at a time through its tiles): a prompt's
rows through `qdot.matmul`, `kernels.matmul` and the batched MoE call get, row for row, the bits
each row gets alone (the coordinator's bitwise check of a worker's rows depends on it), on every
instruction set, within the one-row tolerance of float64, and with no matrix dequantized
(the kernel's own memory is one tile of unpacked blocks per thread: 16 rows, a few KiB a block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kvq.model import qstack
from kvq.model.qstack import QMatrix
from kvq.quant import kernels, qdot
from kvq.tools.synth.quants import random_blocks

if TYPE_CHECKING:
    from test_qdot_batch import Raws

pytestmark = pytest.mark.timeout(120)

ROWS = (16, 65, 100, 512)  # the kernel's first row count, and prompt-sized ones
TOL = 1.2e-2  # the one-row kernel's bound against float64 (tests/quant/test_qdot.py)


def test_amx_is_used_where_the_cpu_has_it(built: qdot.Built) -> None:
    """A CPU that lists AMX int8 tiles (and AVX-512 VNNI) runs the AMX path by default: the
    kernel asks Linux for the tiles' state (arch_prctl) and takes them when granted."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    has = {"amx_tile", "amx_int8", "avx512bw", "avx512_vnni", "avx512vl"} <= flags
    assert (built.best_isa == "amx") == has, (built.best_isa, has)


def _weights(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    raw = random_blocks(qtype, shape, 0.05, rng)
    if qtype == Q.Q6_K:  # int8 scales of both signs, not only random_blocks' 16..63
        blocks = raw.reshape(-1, 210)
        blocks[:, 192:208] = rng.integers(0, 256, (len(blocks), 16), dtype=np.uint8)
    return raw


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_many_rows_get_their_one_row_bits(built: qdot.Built, qtype: Q) -> None:
    """37 weight rows (two full tiles and a short one) times 16..512 rows of x: each row is
    what it gets alone on the scalar path, on every path and thread count."""
    rng = np.random.default_rng(int(qtype) + 100)
    raw = _weights(qtype, (37, 512), rng)
    x = rng.standard_normal((max(ROWS), 512), dtype=np.float32)
    alone = np.concatenate(
        [qdot.matmul(built, x[i : i + 1], raw, qtype, 1, 0) for i in range(len(x))]
    )
    for rows in ROWS:
        for isa in built.paths():
            for threads in (1, 2):
                got = qdot.matmul(built, x[:rows], raw, qtype, threads, isa)
                assert np.array_equal(got, alone[:rows]), (rows, isa, threads)


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_many_rows_match_float64(built: qdot.Built, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype) + 200)
    raw = _weights(qtype, (48, 768), rng)
    ref_w = gguf_dequantize(raw, qtype).astype(np.float64)  # [48, 768]
    x = rng.standard_normal((100, 768), dtype=np.float32)
    ref = x.astype(np.float64) @ ref_w.T
    got = qdot.matmul(built, x, raw, qtype, 2).astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < TOL, f"max relative error {err:.2e}"


@pytest.mark.usefixtures("int8")
def test_quantized_matrix_takes_the_kernel_for_a_prompt_without_dequantizing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`QMatrix.matmul` of 512 rows runs the int8 kernel (each row's one-row bits) and never
    makes the float32 matrix (torch's buffers are not seen by tracemalloc: the dequantizing
    calls are made to fail instead)."""
    rng = np.random.default_rng(7)
    raw = torch.from_numpy(_weights(Q.Q4_K, (1024, 2048), rng))
    m = QMatrix(raw, int(Q.Q4_K), (1024, 2048))
    x = torch.from_numpy(rng.standard_normal((512, 2048), dtype=np.float32))
    assert kernels.covers(m.qtype, 512, x)

    def dense(*_args: object) -> torch.Tensor:
        raise AssertionError("a matrix was dequantized for a prompt")

    monkeypatch.setattr(QMatrix, "dense", dense)
    monkeypatch.setattr(qstack, "dequantize", dense)
    got = m.matmul(x)
    for i in (0, 255, 511):
        assert torch.equal(got[i : i + 1], m.matmul(x[i : i + 1])), i


def test_float32_activations_keep_the_exact_path_over_many_rows(built: qdot.Built) -> None:
    """KVQ_ACTIVATIONS=float32 (or a thread inside `float32_activations`) never takes the int8
    kernel: over the float kernels' row limit it dequantizes and multiplies as before."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("float32", "cc", str(built.path.parent)))
    try:
        x = torch.zeros(512, 256)
        assert not kernels.covers(int(Q.Q4_K), 512, x)
    finally:
        qdot.configure(before)


def _experts(types: tuple[Q, Q, Q], n: int, h: int, f: int, rng: np.random.Generator) -> Raws:
    shapes = ((f, h), (f, h), (h, f))
    return [[_weights(t, s, rng) for t, s in zip(types, shapes, strict=True)] for _ in range(n)]


MOE_TYPES = [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q8_0, Q.Q4_0), (Q.Q5_0, Q.MXFP4, Q.Q4_K)]


@pytest.mark.parametrize("types", MOE_TYPES, ids=["-".join(t.name for t in ts) for ts in MOE_TYPES])
def test_moe_batch_of_a_prompt_gets_each_tokens_bits(built: qdot.Built, types) -> None:
    """100 tokens, top-2 of 4 experts (about 50 pairs each: the tile kernel) and one expert
    with a single pair (the multi-row dots) in the same call: each token's row is the
    one-token call's bits, on every path."""
    from test_qdot_batch import _batch, _one

    rng = np.random.default_rng(sum(int(t) for t in types))
    raws = _experts(types, 5, 512, 256, rng)
    t = 100
    x = rng.standard_normal((t, 512), dtype=np.float32)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(t)])
    ids[7, 1] = 4  # expert 4: one pair
    w = rng.random((t, 2), dtype=np.float32)
    want = _one(built, raws, types, x, ids, w)
    for isa in built.paths():
        got = _batch(built, raws, types, x, ids, w, 2, isa)
        assert np.array_equal(got, want), isa
