"""decode_slice / load_slice against the reader's tensors, for F32 and quantized experts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

from kvq.errors import ModelError, SliceIntegrityError
from kvq.gguf import read_meta, slice_layout
from kvq.gguf.registry import plan_slices
from kvq.model import decode_slice, load_slice, read_slice_file
from kvq.tools.synth import make_tiny
from kvq.tools.synth.quants import QUANT_NAMES


def _full(path: Path, name: str) -> np.ndarray:
    reader = GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)


@pytest.mark.parametrize(("e0", "e1"), [(0, 6), (1, 4), (5, 6)])
def test_decode_slice_equals_tensor_slices(odd_path: Path, e0: int, e1: int) -> None:
    meta = read_meta(odd_path)
    sl = load_slice(odd_path, meta, 1, e0, e1)
    assert (sl.layer, sl.expert_start, sl.expert_end, sl.n_experts) == (1, e0, e1, e1 - e0)
    assert sl.gate.shape == sl.up.shape == (e1 - e0, 48, 32)
    assert sl.down.shape == (e1 - e0, 32, 48)
    for kind in ("gate", "up", "down"):
        want = _full(odd_path, f"blk.1.ffn_{kind}_exps.weight")[e0:e1]
        assert np.array_equal(getattr(sl, kind).numpy(), want)


def test_decode_slice_dtype_and_blob_order(odd_path: Path) -> None:
    meta = read_meta(odd_path)
    layout = slice_layout(meta, 0, 2, 3)
    blobs = read_slice_file(odd_path, layout)
    sl = decode_slice(layout, blobs, 0, 2, 3, dtype=torch.bfloat16)
    assert sl.quantized and sl.compute_dtype == torch.bfloat16 and sl.gate.device.type == "cpu"
    assert sl.nbytes() == sum(len(b) for b in blobs), "kept as the bytes it came in"
    assert sl.to("cpu", torch.float32).compute_dtype == torch.float32
    assert sl.dense_copy().gate.dtype == torch.bfloat16


@pytest.mark.parametrize("cut", [1, 4, 100])
def test_truncated_blob_raises_integrity_error(odd_path: Path, cut: int) -> None:
    meta = read_meta(odd_path)
    layout = slice_layout(meta, 0, 0, 2)
    blobs = read_slice_file(odd_path, layout)
    blobs[2] = blobs[2][:-cut]
    with pytest.raises(SliceIntegrityError, match=r"blk\.0\.ffn_down_exps.*re-download"):
        decode_slice(layout, blobs, 0, 0, 2)


def test_extra_bytes_and_missing_blobs_raise(odd_path: Path) -> None:
    meta = read_meta(odd_path)
    layout = slice_layout(meta, 0, 0, 2)
    blobs = read_slice_file(odd_path, layout)
    with pytest.raises(SliceIntegrityError, match="bytes"):
        decode_slice(layout, [blobs[0] + b"\0", *blobs[1:]], 0, 0, 2)
    with pytest.raises(SliceIntegrityError, match="2 blobs for 3"):
        decode_slice(layout, blobs[:2], 0, 0, 2)


def test_truncated_file_raises_integrity_error(odd_path: Path, tmp_path: Path) -> None:
    meta = read_meta(odd_path)
    layout = slice_layout(meta, 1, 4, 6)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(odd_path.read_bytes()[: layout[2].offset + 10])  # ends inside `down`
    with pytest.raises(SliceIntegrityError, match="truncated"):
        read_slice_file(cut, layout)
    with pytest.raises(ModelError, match="does not exist"):
        read_slice_file(tmp_path / "nope.gguf", slice_layout(meta, 1, 4, 6))


@pytest.mark.parametrize(("slice_layers", "slice_experts"), [(1, 4), (2, 4), (2, 6), (3, 1)])
def test_planned_slices_cut_the_expert_tensors_exactly(
    odd_path: Path, slice_layers: int, slice_experts: int
) -> None:
    meta = read_meta(odd_path)
    specs = plan_slices(meta, odd_path, slice_layers, slice_experts)
    covered: dict[str, list[tuple[int, int]]] = {}
    for spec in specs:
        blobs = read_slice_file(odd_path, list(spec.ranges))
        assert [hashlib.sha256(b).hexdigest() for b in blobs] == list(spec.sha256)
        for layer in spec.layers():
            layout = spec.ranges_of(layer)
            assert layout == slice_layout(meta, layer, spec.expert_start, spec.expert_end)
            sl = decode_slice(
                layout, read_slice_file(odd_path, layout), layer, spec.expert_start, spec.expert_end
            )
            want = load_slice(odd_path, meta, layer, spec.expert_start, spec.expert_end)
            dense = sl.dense_copy()
            assert torch.equal(dense.gate, want.gate) and torch.equal(dense.down, want.down)
        for r in spec.ranges:
            covered.setdefault(r.name, []).append((r.offset, r.offset + r.nbytes))
    for kinds in meta.expert_tensors.values():  # every byte of each stacked tensor, once
        for full in kinds.values():
            spans = sorted(covered[full.name])
            assert spans[0][0] == full.offset and spans[-1][1] == full.offset + full.nbytes
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("quant", sorted(QUANT_NAMES))
@pytest.mark.parametrize(("e0", "e1"), [(0, 1), (1, 3), (3, 4)])
def test_quantized_slices_decode_like_the_whole_tensor(
    quant_models: dict[str, Path], quant: str, e0: int, e1: int
) -> None:
    path = quant_models[quant]
    meta = read_meta(path)
    qtype = QUANT_NAMES[quant]
    block, type_size = GGML_QUANT_SIZES[qtype]
    for layer in range(meta.block_count):
        layout = slice_layout(meta, layer, e0, e1)
        for r in layout:  # block-aligned: each expert is a whole number of rows of blocks
            assert r.ggml_type == qtype
            per_expert = r.expert_shape[0] * r.expert_shape[1] // block * type_size
            assert r.nbytes == (e1 - e0) * per_expert
            assert (r.offset - meta.expert_tensors[layer][r.kind].offset) % per_expert == 0
        sl = load_slice(path, meta, layer, e0, e1)
        for kind in ("gate", "up", "down"):
            want = _full(path, f"blk.{layer}.ffn_{kind}_exps.weight")
            want = want.reshape(meta.expert_count, *getattr(sl, kind).shape[1:])[e0:e1]
            assert np.array_equal(getattr(sl, kind).numpy(), want)


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 4-expert model per supported quant type (256-wide, so K-quants fit)."""
    out = {}
    for quant in QUANT_NAMES:
        path = tmp_path_factory.mktemp("quant") / f"{quant}.gguf"
        make_tiny(path, layers=2, experts=4, hidden=256, expert_ffn=256, quant=quant, seed=2)
        out[quant] = path
    return out
