"""Banks over quantized experts: the cold bank is the mapped GGUF file, the hot bank holds
dequantized copies; swaps stay bit-exact, the file is read only where experts are used, and a
backbone's anonymous memory does not grow with its experts."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bank_helpers import opts

from kvq.bank import Bank
from kvq.bank.layout import resident_bytes
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.model.qstack import QStack
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module", params=["f32", "q8_0", "q4_0"])
def quant_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qbank") / f"tiny-{request.param}.gguf"
    make_tiny(
        path, layers=2, experts=8, experts_used=2, hidden=64, expert_ffn=64, quant=request.param
    )
    return path


def test_experts_stay_encoded_and_swaps_are_bit_exact(quant_model: Path) -> None:
    bb = Backbone.from_gguf(quant_model)
    sl = bb.experts[0]
    assert sl.quantized and all(isinstance(t, QStack) for t in sl.stacks)
    per = resident_bytes(sl, torch.device("cpu"))
    encoded = sum(t.expert_nbytes for t in sl.stacks if isinstance(t, QStack))
    # a CPU computing in float32 keeps hot experts encoded where a fused kernel covers the type
    assert per == (encoded if quant_model.stem != "tiny-f32" else 3 * 64 * 64 * 4)
    bank = Bank(bb.experts.values(), opts(hot_bytes=3 * per, dynamic=True, dyn_steps=2))
    assert bank.hot_bytes == 3 * per  # what the hot bank really stores
    assert bank.cold_bytes == sum(s.nbytes() for s in bb.experts.values())  # the encoded bytes
    tok = load_tokenizer(quant_model)
    prompt = tok.encode("quantized hot and cold")
    want = generate(bb, prompt, 10, stop_at_eos=False)

    def moe(layer, x, ids, w):  # type: ignore[no-untyped-def]
        if layer == 0:
            bank.step()
        return bank.forward(layer, x, ids, w)

    assert generate(bb, prompt, 10, moe=moe, stop_at_eos=False) == want
    assert bank.stats()["swaps"] > 0, "the test must exercise swaps"


def _resident(arr: np.ndarray, start: int, nbytes: int) -> int:
    """Pages of arr[start:start+nbytes] resident in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    base = arr.ctypes.data + start
    lo = base - base % page
    n = (base + nbytes - lo + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0
    return sum(v & 1 for v in vec)


def test_mapping_reads_no_expert_bytes_until_they_are_used(tmp_path: Path) -> None:
    """Page-cache residency (mincore) of the expert tensor: the kernel's readahead may pull in
    a few MB around what is touched, so the check looks at experts far from anything read."""
    path = tmp_path / "wide.gguf"
    # 64 experts of 256 x 512 f32 = 512 KiB per gate matrix: a 32 MiB gate tensor
    make_tiny(path, layers=1, experts=64, experts_used=1, hidden=256, expert_ffn=512)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start from a cold page cache
    os.close(fd)
    bb = Backbone.from_gguf(path)
    gate = bb.experts[0].gate
    assert isinstance(gate, QStack)
    arr, per = gate.raw.numpy(), gate.expert_nbytes
    far = (24 * per, 12 * per)  # experts 24-35: > 12 MiB from the tensor's start
    pages = far[1] // mmap.PAGESIZE
    assert _resident(arr, *far) == 0, "experts were read at load"
    bb.local_moe(0, torch.randn(1, 256), torch.tensor([[44]]), torch.ones(1, 1))
    assert _resident(arr, 44 * per, per) >= per // mmap.PAGESIZE, "the routed expert was read"
    assert _resident(arr, *far) <= pages // 10, "unrouted experts were read"


_CHILD = r"""
import json, sys, torch
from kvq.model import Backbone
from kvq.model.generate import generate
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
a0 = anon()
bb = Backbone.from_gguf(sys.argv[1])
for layer in range(bb.meta.block_count):
    x = torch.randn(4, bb.meta.embedding_length)
    ids = torch.randint(0, bb.meta.expert_count, (4, bb.meta.expert_used_count))
    bb.local_moe(layer, x, ids, torch.ones(ids.shape) / ids.shape[1])
print(json.dumps({"anon_growth": anon() - a0}))
"""


def test_backbone_anonymous_memory_does_not_hold_the_experts(tmp_path: Path) -> None:
    path = tmp_path / "heavy.gguf"
    make_tiny(path, layers=2, experts=32, experts_used=2, hidden=256, expert_ffn=512)
    dense_experts = 2 * 32 * 3 * 256 * 512 * 4  # what fp32 dequantized experts would take
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    growth = json.loads(out.stdout.strip().splitlines()[-1])["anon_growth"]
    assert growth < dense_experts / 4, (
        f"anonymous memory grew {growth} bytes (experts: {dense_experts})"
    )


@pytest.mark.parametrize("quant", ["f32", "mxfp4"])
def test_gpt_oss_bank_computes_the_expert_biases_and_clamped_swiglu(
    tmp_path: Path, quant: str
) -> None:
    """A bank over gpt-oss's slices (MXFP4 experts and their biases, the clamped SwiGLU),
    hot and cold experts swapping, generates what the backbone's own experts generate; the
    biases live in the bank, so a worker computes them."""
    path = tmp_path / f"gpt-oss-{quant}.gguf"
    make_tiny(path, arch="gpt-oss", layers=2, experts=8, hidden=64, expert_ffn=64, quant=quant)
    bb = Backbone.from_gguf(path)
    assert all(sl.biases is not None and sl.act == "swiglu_oai" for sl in bb.experts.values())
    per = resident_bytes(bb.experts[0], torch.device("cpu"))
    bank = Bank(bb.experts.values(), opts(hot_bytes=3 * per, dynamic=True, dyn_steps=2))
    prompt = load_tokenizer(path).encode("sinks and windows")
    want = generate(bb, prompt, 10, stop_at_eos=False)

    def moe(layer, x, ids, w):  # type: ignore[no-untyped-def]
        if layer == 0:
            bank.step()
        return bank.forward(layer, x, ids, w)

    assert generate(bb, prompt, 10, moe=moe, stop_at_eos=False) == want
    assert bank.stats()["swaps"] > 0, "the test must exercise swaps"
