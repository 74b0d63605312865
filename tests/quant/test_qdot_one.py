"""One row of x against several matrices in one call (`qdot.matmul_one`, a decode step's q,
k and v): each output has the bits of `qdot.matmul` on that matrix alone, on every path and
thread count, with rows not a multiple of the 8-row kernels' group and rows longer than their
pass of blocks; the model's `linears` takes it for one row and gives `linear`'s bits."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvq.model.layers import linear, linears
from kvq.model.qstack import QMatrix
from kvq.quant import kernels, qdot
from kvq.tools.synth.quants import random_blocks

ISAS = (0, 1, 2, 3, 4)  # scalar, AVX2, AVX2 + VNNI, AVX-512, AMX (lowered to what the CPU has)
# (type, rows): 67 and 9 rows leave a part group of the 8-row kernels
MATS = ((Q.Q4_K, 67), (Q.Q6_K, 9), (Q.Q8_0, 16), (Q.Q4_K, 8), (Q.MXFP4, 5), (Q.Q5_K, 3))


def _mats(cols: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    raws = [random_blocks(t, (n, cols), 0.02, rng) for t, n in MATS]
    return raws, rng.standard_normal((1, cols)).astype(np.float32)


def _one(built: qdot.Built, raws: list[np.ndarray], x: np.ndarray, threads: int, isa: int):
    outs = [np.empty(r.shape[0], dtype=np.float32) for r in raws]
    mats = [
        (r.ctypes.data, r.shape[0], r.shape[1], int(t))
        for r, (t, _) in zip(raws, MATS, strict=True)
    ]
    qdot.matmul_one(
        built, x.ctypes.data, x.shape[1], mats, [o.ctypes.data for o in outs], threads, isa
    )
    return outs


@pytest.mark.parametrize("cols", [1024, 9216])  # 9216: 36 blocks of 256, more than one pass
def test_each_output_has_the_bits_of_its_own_matmul(built: qdot.Built, cols: int) -> None:
    raws, x = _mats(cols, seed=cols)
    alone = [qdot.matmul(built, x, r, t, 1, 0)[0] for r, (t, _) in zip(raws, MATS, strict=True)]
    for isa in ISAS:
        for threads in (1, 2, 3):
            got = _one(built, raws, x, threads, isa)
            for m, (a, b) in enumerate(zip(got, alone, strict=True)):
                assert np.array_equal(a, b), (MATS[m], isa, threads)


def test_bad_calls_are_refused(built: qdot.Built) -> None:
    raws, x = _mats(1024, seed=1)
    with pytest.raises(ValueError, match="columns not a multiple"):
        _one(built, raws, x[:, :1000].copy(), 1, -1)


def test_linears_takes_one_call_for_one_row_with_linears_bits(
    int8: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = kernels.matmul_one
    monkeypatch.setattr(kernels, "matmul_one", lambda x, w: calls.append(len(w)) or real(x, w))
    raws, x = _mats(1024, seed=2)
    ws = [
        QMatrix(torch.from_numpy(r), int(t), (n, 1024))
        for r, (t, n) in zip(raws, MATS, strict=True)
    ]
    xt = torch.from_numpy(x)
    for rows in (xt, torch.cat([xt, xt * 0.5])):  # one row: matmul_one; two: linear each
        for got, w in zip(linears(rows, ws), ws, strict=True):
            assert torch.equal(got, linear(rows, w))
    assert calls == [len(MATS)]


def test_one_row_calls_have_the_same_bits_on_any_threads_and_callers(built: qdot.Built) -> None:
    """A one-row call gives the bits of one thread on any number of them; two
    Python threads calling at once each get their own results."""
    raws, x = _mats(2048, seed=3)
    raw, qtype = raws[0], MATS[0][0]
    one = qdot.matmul(built, x, raw, qtype, 1)
    for threads in (2, 3, 7):
        assert np.array_equal(qdot.matmul(built, x, raw, qtype, threads), one), threads
    got: list[bool] = []

    def call() -> None:
        for _ in range(20):
            got.append(np.array_equal(qdot.matmul(built, x, raw, qtype, 2), one))

    callers = [threading.Thread(target=call) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert got == [True] * 60
