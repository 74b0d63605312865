"""make_tiny -> read_meta round trip, slice byte layout, and the plain-dict form."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from kvq.catalog import meta_from_dict, meta_to_dict
from kvq.errors import ModelError
from kvq.gguf import read_meta, slice_layout, slice_nbytes
from kvq.model import read_slice_file


def test_read_meta_has_every_value(odd_path: Path) -> None:
    m = read_meta(odd_path)
    assert (m.arch, m.block_count, m.expert_count, m.expert_used_count) == ("qwen3moe", 2, 6, 3)
    assert (m.embedding_length, m.expert_feed_forward_length, m.feed_forward_length) == (32, 48, 48)
    assert (m.head_count, m.head_count_kv, m.head_dim) == (4, 2, 8)
    assert m.rope_freq_base == 1e6
    assert m.rms_eps == pytest.approx(1e-6)
    assert m.context_length == 512
    assert (m.vocab_size, m.bos_id, m.eos_id) == (258, 256, 257)
    assert m.tokenizer_model == "kvq-bytes"
    assert m.name.startswith("kvq-tiny")
    assert m.file_size == odd_path.stat().st_size
    assert sorted(m.expert_tensors) == [0, 1]
    for layer, kinds in m.expert_tensors.items():
        assert kinds["gate"].name == f"blk.{layer}.ffn_gate_exps.weight"
        assert kinds["gate"].expert_shape == kinds["up"].expert_shape == (48, 32)
        assert kinds["down"].expert_shape == (32, 48)
        for r in kinds.values():
            assert r.ggml_type == GGMLQuantizationType.F32
            assert r.nbytes == 6 * 48 * 32 * 4


def _tensor_bytes(path: Path, name: str, e0: int, e1: int) -> bytes:
    reader = GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    return bytes(t.data[e0:e1].tobytes())


@pytest.mark.parametrize(("e0", "e1"), [(0, 6), (0, 1), (2, 5), (5, 6)])
def test_slice_bytes_equal_reader_tensor_slices(odd_path: Path, e0: int, e1: int) -> None:
    meta = read_meta(odd_path)
    for layer in range(meta.block_count):
        layout = slice_layout(meta, layer, e0, e1)
        assert [r.kind for r in layout] == ["gate", "up", "down"]
        blobs = read_slice_file(odd_path, layout)
        for r, blob in zip(layout, blobs, strict=True):
            assert blob == _tensor_bytes(odd_path, r.name, e0, e1)
        assert slice_nbytes(meta, layer, e0, e1) == sum(map(len, blobs))
        assert slice_nbytes(meta, layer, e0, e1) == 3 * (e1 - e0) * 48 * 32 * 4


class CountingFile(io.RawIOBase):
    """A file wrapper that records the (offset, size) of every read."""

    def __init__(self, f: io.BufferedReader) -> None:
        self.f = f
        self.reads: list[tuple[int, int]] = []

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        pos = self.f.tell()
        data = self.f.read(size)
        self.reads.append((pos, len(data)))
        return data


def test_slice_read_touches_only_its_own_bytes(odd_path: Path) -> None:
    meta = read_meta(odd_path)
    layout = slice_layout(meta, 1, 2, 4)
    with open(odd_path, "rb", buffering=0) as raw:
        counting = CountingFile(raw)  # type: ignore[arg-type]
        read_slice_file(counting, layout)  # type: ignore[arg-type]
    assert sum(n for _, n in counting.reads) == slice_nbytes(meta, 1, 2, 4)
    assert counting.reads == [(r.offset, r.nbytes) for r in layout]


@pytest.mark.parametrize(
    ("layer", "e0", "e1", "words"),
    [
        (2, 0, 1, "layer 2"),
        (-1, 0, 1, "layer -1"),
        (0, 3, 3, "[3, 3)"),
        (0, 4, 7, "[4, 7)"),
        (0, -1, 2, "[-1, 2)"),
        (0, 1.0, 2, "expert_start"),
    ],
)
def test_slice_layout_rejects_bad_ranges(
    odd_path: Path, layer: int, e0: Any, e1: int, words: str
) -> None:
    with pytest.raises(ModelError, match=words.replace("[", r"\[").replace(")", r"\)")):
        slice_layout(read_meta(odd_path), layer, e0, e1)


def _plain(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, int | float | str)


def test_meta_dict_round_trip_through_json(odd_path: Path) -> None:
    meta = read_meta(odd_path)
    d = meta_to_dict(meta)
    assert _plain(d)
    back = meta_from_dict(json.loads(json.dumps(d)))
    assert back == meta
    assert slice_layout(back, 1, 1, 3) == slice_layout(meta, 1, 1, 3)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: d.pop("expert_count"), "expert_count"),
        (lambda d: d.update(block_count="2"), "block_count"),
        (lambda d: d.update(expert_tensors={}), "expert_tensors"),
        (lambda d: d["expert_tensors"][0][0].pop("offset"), "lacks one of"),
        (lambda d: d["expert_tensors"][0][1].update(kind="gate"), "repeats a kind"),
        (lambda d: d["expert_tensors"][1][2].update(offset="9"), "layer 1: key 'offset'"),
        (lambda d: d["expert_tensors"][0][0].update(kind="ffn"), "kind 'ffn' is not one of"),
        (lambda d: d["expert_tensors"][0][0].update(expert_shape=[4, 1.5]), "'expert_shape'"),
        (lambda d: d["expert_tensors"][0].pop(), "must list"),
    ],
)
def test_meta_from_dict_names_bad_key(odd_path: Path, mutate: Any, words: str) -> None:
    d = json.loads(json.dumps(meta_to_dict(read_meta(odd_path))))
    mutate(d)
    with pytest.raises(ModelError, match=words):
        meta_from_dict(d)


def test_default_tiny_matches_brief(tiny_path: Path) -> None:
    m = read_meta(tiny_path)
    assert (m.block_count, m.expert_count, m.expert_used_count, m.embedding_length) == (2, 8, 2, 64)
    assert m.expert_feed_forward_length == 64 and m.head_dim == 16
