"""A worker computes a many-row job (a prompt's slice) with the coordinator's own kernel: the
slice's downloaded bytes go through `decode_slice`, a `Bank` and `ExpertServer.handle`, as
`kvq.worker.loader.Loader.load` builds them, and a 64-row job reaches the same int8 MoE entry
point (`qdot.moe_batch`, the C `kvq_qdot_moe_batch`, whose experts of 16 rows or more take the
tile kernel on AVX-512) with the same rows per expert as the coordinator's local call, and
gives the same bits once its per-pair terms are added in the coordinator's order. Not a timing: the calls are recorded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.device import compute_dtype
from kvq.gguf import read_meta, slice_layout
from kvq.model import Backbone, decode_slice
from kvq.model.moe_sum import combine, inside
from kvq.quant import kernels, qdot
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.timeout(120)

ROWS = 64  # a prefill slice: 64 tokens, 2 of 8 experts each
GEMM_MIN = 16  # csrc/qdot_gemm.h: an expert with this many rows takes the tile kernel
OPTS = BankOptions(hot_bytes=0, numa_policy="off", vram_reserve_bytes=0, dynamic=False)


@pytest.fixture
def int8() -> Iterator[None]:
    """The default, int8 activations (the C kernel), whatever an earlier test configured."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("int8", before.cc, before.cache_dir))
    if not kernels.int8_active():
        qdot.configure(before)
        pytest.skip("no C compiler: both sides run the float32 kernels")
    yield
    qdot.configure(before)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int]]]:
    """Every call of the batched int8 MoE entry point: (rows of x, rows of each expert)."""
    seen: list[tuple[int, list[int]]] = []
    real = qdot.moe_batch

    def moe_batch(*args: Any, **kw: Any) -> Any:
        seen.append((int(args[1].shape[0]), np.diff(args[3]).tolist()))  # x [T, H]; start
        return real(*args, **kw)

    monkeypatch.setattr(qdot, "moe_batch", moe_batch)
    return seen


def _worker(path: Path, layer: int) -> ExpertServer:
    """What `Loader.load` serves for experts [0, 8) of `layer`: the bytes a download gives,
    decoded in the dtype the worker's settings pick (`auto`)."""
    ranges = slice_layout(read_meta(path), layer, 0, 8)
    with path.open("rb") as f:
        blobs = []
        for r in ranges:
            f.seek(r.offset)
            blobs.append(f.read(r.nbytes))
    dtype = compute_dtype(torch.device("cpu"), "auto", (r.ggml_type for r in ranges))
    bank = Bank([decode_slice(ranges, blobs, layer, 0, 8, dtype=dtype)], OPTS, "cpu")
    return ExpertServer("w", "tiny", bank, read_meta(path).embedding_length, dtype)


@pytest.mark.usefixtures("int8")
def test_a_prefill_job_takes_the_coordinators_kernel_and_bits(
    tmp_path: Path, calls: list[tuple[int, list[int]]]
) -> None:
    path = tmp_path / "q4_k_m.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, hidden=256, expert_ffn=256, quant="q4_k_m")
    bb = Backbone.from_gguf(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 256), dtype=np.float32)
    t = np.arange(ROWS)
    ids = np.stack([t % 8, (t + 3) % 8], 1).astype(np.int64)  # 16 rows for each expert
    w = rng.uniform(0.1, 1.0, (ROWS, 2)).astype(np.float32)
    xt, it, wt = torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w)
    for layer in (0, 1):  # layer 1: Q6_K down in Q4_K_M, layer 0 Q4_K
        local = bb.local_moe(layer, xt, it, wt).numpy()  # the coordinator's own call
        bank = Bank(bb.experts.values(), OPTS, "cpu").forward(layer, xt, it, wt).numpy()
        local_calls = calls[:]
        calls.clear()
        job = wire.Job(
            job_id="j",
            model="tiny",
            layer=layer,
            slice="s",
            expert_start=0,
            expert_end=8,
            coord="c",
            reply_to="out",
            deadline_ms=0,
            x=wire.Tensor.of(x),
            ids=wire.Tensor.of(ids),
            weights=wire.Tensor.of(w),
        )
        res = _worker(path, layer).handle(job)
        assert res.error is None, res.error
        assert res.y is not None and res.dtype == "q8"  # int8 activations, said so
        terms = torch.from_numpy(res.y.array().copy())  # [2 * ROWS, H]: one row per pair
        remote = combine(it, 256, torch.float32, [(inside(it, 0, 8), terms)]).numpy()
        assert np.array_equal(remote, local) and np.array_equal(bank, local), layer
        # one call on each side, the same rows per expert, 16 each: the tile kernel on
        # AVX-512 (the worker's rows are the pairs, each row once per expert)
        assert local_calls == [(ROWS, [GEMM_MIN] * 8)] * 2
        assert calls == [(2 * ROWS, [GEMM_MIN] * 8)]
        calls.clear()
    built = kernels.int8_kernel()
    assert built is not None
    isa = built.isa(qdot.options().isa)
    assert ("tile" in qdot.many_rows_kernel(isa)) == (isa in ("avx512", "amx"))
