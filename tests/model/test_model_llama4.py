"""Llama-4 (`llama4`) against llama.cpp itself on the same files: `make_tiny --arch llama4`
writes every part the real files use (dense and MoE layers interleaved, the shared expert,
top-1 sigmoid routing that scales the expert's input, NoPE layers, chunked attention, the
q/k norm, llama3 `rope_freqs`), llama.cpp loads it, and kvq's greedy tokens and logits equal
llama.cpp's (F32 file, F32 KV cache), over a short prompt and over one long enough to cross
llama.cpp's fixed chunk of 8192 positions and the attention temperature's first step. The
parts that do not need llama.cpp (one MoE layer, the chunk mask, the temperature, slices of
the interleaved layers) are checked against slow references here too. The llama.cpp tests
skip where llama_cpp is not installed."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from greedy import kvq_greedy, llama_greedy

from kvq.catalog import meta_from_dict, meta_to_dict
from kvq.gguf import read_meta
from kvq.gguf.reader import open_reader, tensor_map
from kvq.gguf.registry import plan_slices
from kvq.model import Backbone, SeqStep
from kvq.model.expert_slice import decode_slice, load_slice, read_slice_file
from kvq.model.layers import Gating, attn_temperature, causal_attention, rms_norm
from kvq.model.loader import MoeFfn
from kvq.model.moe_ffn import moe_ffn
from kvq.model.threads import one_thread
from kvq.slices import SliceSpec
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny
from kvq.tools.synth.tiny import family_parts, write_tiny
from kvq.tools.synth.tiny_weights import TinyConfig

DIMS = {
    "layers": 4,
    "experts": 8,
    "hidden": 256,
    "expert_ffn": 256,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
}
SMALL = {
    "layers": 4,
    "experts": 8,
    "hidden": 64,
    "expert_ffn": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
}
PROMPT = "The quick brown fox jumps over"
STEPS = 16
CHUNK = 8192
needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed"
)


def write(tmp_path: Path, dims: dict[str, int] = DIMS, **parts: int) -> Path:
    """The family's tiny file; `parts` overrides TinyConfig fields after `family_parts`."""
    path = tmp_path / f"llama4-{dims['hidden']}-{len(parts)}.gguf"
    if not parts:
        make_tiny(path, arch="llama4", tokenizer="bpe", **dims)
        return path
    cfg = TinyConfig(experts_used=1, **dims)  # type: ignore[arg-type]
    write_tiny(path, replace(family_parts(cfg, "llama4"), **parts), arch="llama4", tokenizer="bpe")
    return path


def test_tiny_file_carries_every_part(tmp_path: Path) -> None:
    path = write(tmp_path)
    m = read_meta(path)
    assert m.arch == "llama4" and list(m.moe_layers) == [1, 3] and m.moe_layer_step == 2
    assert (m.expert_used_count, m.expert_gating, m.expert_weights_norm) == (1, "sigmoid", False)
    assert m.expert_shared_feed_forward_length == m.expert_feed_forward_length
    assert [m.chunk(i) for i in range(4)] == [CHUNK, CHUNK, CHUNK, 0]
    assert [m.ropes(i) for i in range(4)] == [True, True, True, False]  # layer 3: NoPE
    assert m.kq_norm and (m.attn_temp_floor, m.attn_temp_scale) == (8192, 0.1)
    assert m.context_length > CHUNK  # a test can cross the chunk
    names = set(tensor_map(open_reader(path)))
    assert {
        "rope_freqs.weight",
        "blk.0.ffn_up.weight",
        "blk.2.ffn_down.weight",
        "blk.1.ffn_up_shexp.weight",
        "blk.3.ffn_gate_exps.weight",
    } <= names
    assert "blk.0.ffn_gate_inp.weight" not in names and "blk.1.ffn_up.weight" not in names


def test_a_file_without_chunks_ropes_all_layers_but_the_last(tmp_path: Path) -> None:
    """`attention.sliding_window = 0` (the converter's mark of all-full layers): no chunks,
    no temperature, and llama.cpp's NoPE step of block_count."""
    path = tmp_path / "llama4-full.gguf"
    cfg = family_parts(TinyConfig(experts_used=1, **SMALL), "llama4")  # type: ignore[arg-type]
    write_tiny(path, cfg, arch="llama4", extra=lambda w: w.add_sliding_window(0))
    m = read_meta(path)
    assert [m.window(i) for i in range(4)] == [0] * 4 and m.attn_temp_floor == 0
    assert [m.ropes(i) for i in range(4)] == [True, True, True, False]


@needs_llama
def test_f32_greedy_tokens_and_logits_equal_llama_cpp(tmp_path: Path) -> None:
    path = write(tmp_path)
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, our_logits, strict=True)]
    assert min(corr) >= 0.9999, corr


@needs_llama
def test_top2_routing_scales_each_choice_input_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp runs any top-k for llama4: each chosen expert reads the input times its own
    weight (kvq sends one row per choice)."""
    path = write(tmp_path, experts_used=2)
    assert read_meta(path).expert_used_count == 2
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, our_logits, strict=True)]
    assert min(corr) >= 0.9999, corr


@needs_llama
def test_128_experts_run_without_the_kq_norm_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp turns the q/k norm off for 128 experts (Maverick's 17B-128E); so does kvq."""
    path = tmp_path / "llama4-128e.gguf"
    make_tiny(path, arch="llama4", tokenizer="bpe", **(SMALL | {"experts": 128, "expert_ffn": 32}))
    assert not read_meta(path).kq_norm
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, our_logits, strict=True)]
    assert min(corr) >= 0.9999, corr


def _long_run(bb: Backbone, ids: list[int], then: list[int]) -> np.ndarray:
    """kvq's logits [len(then), V] after `ids` (prefilled in passes of 1024 tokens) and after
    each token of `then` but the last, one decode step at a time."""
    cache = bb.new_cache()
    for i in range(0, len(ids), 1024):
        logits = bb.forward([SeqStep(ids[i : i + 1024], cache)])[0]
    rows = []
    for tok in then:
        rows.append(logits.double().numpy())
        logits = bb.forward([SeqStep([tok], cache)])[0]
    return np.stack(rows)


@needs_llama
@pytest.mark.timeout(600)
def test_long_context_crosses_the_chunk_and_the_temperature_step_as_llama_cpp(
    tmp_path: Path,
) -> None:
    """A prompt of 8185 tokens, then 16 greedy steps: the queries at 8191 on see a NoPE
    temperature of 1 + 0.1 ln 2, those at 8192 on a new chunk. kvq equals llama.cpp, and
    without either part it would not (both are reached)."""
    path = write(tmp_path, SMALL)
    base = load_tokenizer(path).encode("The quick brown fox jumps over the lazy dog. ")
    n = CHUNK - 7
    ids = (base * (n // len(base) + 1))[:n]
    theirs, their_logits = llama_greedy(path, ids, STEPS, n_ctx=CHUNK + 256)
    meta = read_meta(path)
    ours = _long_run(Backbone.from_gguf(path, meta=meta), ids, theirs)
    assert [int(r.argmax()) for r in ours] == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, ours, strict=True)]
    assert min(corr) >= 0.9999, corr
    # row i holds the logits of position n - 1 + i: 8191 is row 7, 8192 row 8
    for part, first in (({"attn_temp_floor": 0}, 7), ({"swa_chunked": False}, 8)):
        other = _long_run(Backbone.from_gguf(path, meta=replace(meta, **part)), ids, theirs)
        diff = np.abs(other - their_logits).max(axis=1)
        assert diff[:first].max() < 1e-3 and diff[first:].min() > 1e-2, (part, diff)


def _reference_moe_layer(path: Path, layer: int, x: np.ndarray, k: int) -> np.ndarray:
    """One llama4 MoE FFN in float64 numpy from the file's tensors: top-k of the router's
    logits, each chosen expert run on x * sigmoid(logit), plus the shared expert on x."""
    t = {t.name: np.asarray(t.data, dtype=np.float64) for t in GGUFReader(path).tensors}
    p = f"blk.{layer}."

    def ffn(v: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        g = gate @ v
        return down @ (g / (1 + np.exp(-g)) * (up @ v))  # [H]

    out = np.zeros_like(x)
    for r, row in enumerate(x):
        logits = t[p + "ffn_gate_inp.weight"] @ row  # [E]
        for e in np.argsort(-logits, kind="stable")[:k]:
            w = 1 / (1 + np.exp(-logits[e]))
            out[r] += ffn(
                w * row, *(t[p + f"ffn_{kind}_exps.weight"][e] for kind in ("gate", "up", "down"))
            )
        out[r] += ffn(row, *(t[p + f"ffn_{kind}_shexp.weight"] for kind in ("gate", "up", "down")))
    return out


def _run_moe_layer(bb: Backbone, layer: int, x: torch.Tensor, gating: Gating) -> torch.Tensor:
    ffn = bb.layers[layer].ffn
    assert isinstance(ffn, MoeFfn) and ffn.shared is not None
    calls = moe_ffn(layer, ffn, x, gating, bb.spec.scale_input, one_thread)
    call = next(calls)
    try:
        calls.send(bb.local_moe(*call))
    except StopIteration as done:
        out: torch.Tensor = done.value
        return out
    raise AssertionError("moe_ffn asked for a second call")


@pytest.mark.parametrize("k", [1, 2])
def test_moe_layer_scales_the_expert_input_as_the_float64_reference(tmp_path: Path, k: int) -> None:
    path = write(tmp_path, SMALL)
    bb = Backbone.from_gguf(path)
    gen = torch.Generator().manual_seed(k)
    x = rms_norm(torch.randn(6, 64, generator=gen) * 3, None, 1e-6)  # [T, H] like a normed row
    got = _run_moe_layer(bb, 3, x, replace(bb.gating, k=k)).double().numpy()
    want = _reference_moe_layer(path, 3, x.double().numpy(), k)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the same weights on the experts' outputs give other values: the input scaling is real
    bb.spec = replace(bb.spec, scale_input=False)
    other = _run_moe_layer(bb, 3, x, replace(bb.gating, k=k)).double().numpy()
    assert np.abs(other - want).max() > 1e-3


def test_chunked_attention_equals_a_loop() -> None:
    """Queries at 5..10 against keys 2..10 in chunks of 4: a query at p sees keys from
    p // 4 * 4 to p; a decode step (one query) is masked the same way."""
    gen = torch.Generator().manual_seed(2)
    heads, kv, d, chunk, k_start = 4, 2, 8, 4, 2
    k = torch.randn(9, kv, d, generator=gen, dtype=torch.float64)  # positions 2..10
    v = torch.randn(9, kv, d, generator=gen, dtype=torch.float64)
    for q_start, t in ((5, 6), (10, 1)):
        q = torch.randn(t, heads, d, generator=gen, dtype=torch.float64)
        keys = k[: q_start + t - k_start]
        got = causal_attention(q, keys, v[: len(keys)], q_start, 0.0, None, chunk, k_start, chunk)
        got = got.view(t, heads, d)
        for i in range(t):
            p = q_start + i
            keep = [j for j in range(len(keys)) if p // chunk * chunk <= k_start + j <= p]
            for h in range(heads):
                sc = torch.stack([q[i, h] @ k[j, h // 2] for j in keep]) / math.sqrt(d)
                want = (torch.softmax(sc, 0)[:, None] * v[keep, h // 2]).sum(0)
                torch.testing.assert_close(got[i, h], want)


def test_attention_temperature_steps_every_8192_positions() -> None:
    pos = torch.tensor([0, 8190, 8191, 16382, 16383])
    want = [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)]
    torch.testing.assert_close(attn_temperature(pos, 8192, 0.1), torch.tensor(want))


def test_slices_hold_the_interleaved_moe_layers(tmp_path: Path) -> None:
    """Slices of 2 MoE layers span layers [1, 4) step 2: a worker decodes layers 1 and 3 from
    their ranges, as `load_slice` reads them; the published JSON and layout round-trip."""
    path = write(tmp_path, SMALL)
    meta = read_meta(path)
    specs = plan_slices(meta, path, slice_layers=2, slice_experts=4)
    assert [s.sid for s in specs] == ["L001-004:E0000-0004", "L001-004:E0004-0008"]
    for spec in specs:
        assert list(spec.layers()) == [1, 3] and spec.layer_step == 2
        assert SliceSpec.from_json(spec.sid, spec.to_json()) == spec
        for layer in spec.layers():
            ranges = spec.ranges_of(layer)
            assert all(r.name.startswith(f"blk.{layer}.") for r in ranges)
            sl = decode_slice(
                ranges, read_slice_file(path, ranges), layer, spec.expert_start, spec.expert_end
            )
            want = load_slice(path, meta, layer, spec.expert_start, spec.expert_end)
            assert torch.equal(sl.dense_copy().down, want.dense_copy().down)
    assert [s.sid for s in plan_slices(meta, path, 1, 8)] == [
        "L001-002:E0000-0008",
        "L003-004:E0000-0008",
    ]
    assert meta_from_dict(meta_to_dict(meta)) == meta
