"""qwen35moe (Qwen3.5 MoE) against llama.cpp itself on the same file: `make_tiny --arch
qwen35moe` writes both kinds of layer (Gated DeltaNet linear attention and gated full
attention), the sigmoid-gated shared expert, partial IMROPE with an e section; llama.cpp loads
it and kvq's greedy tokens and logits equal llama.cpp's (F32 file, F32 KV cache). The
recurrent state beside the KV cache is checked here too: sequences batched together, a prompt
in chunks, and a failed pass retried each give the logits of one clean pass. The llama.cpp
test skips where llama_cpp is not installed."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from greedy import kvq_greedy, llama_greedy, llama_model

from kvq.catalog import meta_from_dict, meta_to_dict
from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf.describe import MemoryAssumptions, describe_model
from kvq.gguf.reader import open_reader, tensor_map
from kvq.model import Backbone, SeqStep
from kvq.model.deltanet import DeltaWeights
from kvq.model.layers import Rope
from kvq.model.qstack import QMatrix
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny
from kvq.tools.synth.tiny import family_parts, write_tiny
from kvq.tools.synth.tiny_weights import TinyConfig

DIMS = {
    "layers": 4,
    "experts": 8,
    "hidden": 128,
    "expert_ffn": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 32,
}
PROMPT = "The quick brown fox jumps over"
STEPS = 16
F32_ANGLES = {"rtol": 1e-5, "atol": 1e-5}
needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed"
)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("qwen35moe") / "qwen35moe-f32.gguf"
    make_tiny(p, arch="qwen35moe", tokenizer="bpe", **DIMS)
    return p


def test_tiny_file_carries_every_part(path: Path) -> None:
    m = read_meta(path)
    assert m.arch == "qwen35moe" and m.full_attention_interval == 2
    assert m.recurrent_layers == [0, 2]  # layers 1 and 3 are full attention
    assert (m.ssm_group_count, m.ssm_time_step_rank) == (2, 4)  # value heads tile key heads
    assert m.rope_sections == (1, 1, 1, 1) and m.rope_dims == 16 < m.head_dim
    assert meta_from_dict(json.loads(json.dumps(meta_to_dict(m)))) == m  # published layouts
    t = tensor_map(open_reader(path))
    for part in (
        "attn_qkv.weight",
        "attn_gate.weight",
        "ssm_conv1d.weight",
        "ssm_dt.bias",
        "ssm_a",
        "ssm_beta.weight",
        "ssm_alpha.weight",
        "ssm_norm.weight",
        "ssm_out.weight",
    ):
        assert f"blk.0.{part}" in t and f"blk.1.{part}" not in t
    # full attention: q and its output gate in one attn_q, per-head q/k norms
    assert tuple(t["blk.1.attn_q.weight"].shape) == (128, 2 * 4 * 32)  # GGUF order
    for part in (
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "post_attention_norm.weight",
        "ffn_gate_inp_shexp.weight",
        "ffn_up_shexp.weight",
    ):
        assert f"blk.1.{part}" in t
    assert "blk.0.attn_q.weight" not in t


@needs_llama
def test_f32_greedy_tokens_and_logits_equal_llama_cpp(path: Path) -> None:
    """16 greedy tokens equal, logits correlation >= 0.9999 (measured: 1 - 5e-13) and every
    logit within 1e-3 (measured 1.1e-5 of logits up to 12.6; rotating IMROPE's e pairs as
    well, the one error the correlation alone would pass at 0.99997, is 0.075 off)."""
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, our_logits, strict=True)]
    assert min(corr) >= 0.9999, corr
    assert float(np.abs(their_logits - our_logits).max()) <= 1e-3


@needs_llama
def test_real_layout_with_an_mtp_block_equals_llama_cpp(tmp_path: Path) -> None:
    """The real files' layout: full attention every 4th layer (3 DeltaNet layers, then one),
    IMROPE sections with e = 0 (every pair rotates), and an MTP block after the trunk
    (`nextn_predict_layers` 1: llama.cpp and kvq load past it). Measured: 1 - corr 3.3e-12,
    logits within 2.9e-5."""
    cfg = family_parts(TinyConfig(4, 8, 2, 128, 64, 4, 2, 32), "qwen35moe")
    cfg = replace(cfg, full_attention_interval=4, rope_sections=(3, 3, 2, 0), nextn=1)
    path = tmp_path / "qwen35moe-real-layout.gguf"
    write_tiny(path, cfg, arch="qwen35moe", tokenizer="bpe")
    m = read_meta(path)
    assert (m.block_count, m.nextn_predict_layers, m.recurrent_layers) == (4, 1, [0, 1, 2])
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(their_logits, our_logits, strict=True)]
    assert min(corr) >= 0.9999, corr
    assert float(np.abs(their_logits - our_logits).max()) <= 1e-3


@needs_llama
def test_recurrent_layers_array_overrides_the_interval(tmp_path: Path) -> None:
    """Files converted from a config with `layer_types` carry `attention.recurrent_layers`
    (one flag per block, the MTP block's false), which llama.cpp reads instead of
    `full_attention_interval`: here a pattern the interval cannot give (layers 0, 2 and 3
    linear, interval 2 also written)."""
    cfg = family_parts(TinyConfig(4, 8, 2, 128, 64, 4, 2, 32), "qwen35moe")
    cfg = replace(cfg, recurrent_pattern=(True, False, True, True), nextn=1)
    path = tmp_path / "qwen35moe-layer-types.gguf"
    write_tiny(path, cfg, arch="qwen35moe", tokenizer="bpe")
    m = read_meta(path)
    assert m.full_attention_interval == 2 and m.recurrent_layers == [0, 2, 3]
    assert meta_from_dict(json.loads(json.dumps(meta_to_dict(m)))) == m
    ids = load_tokenizer(path).encode(PROMPT)
    theirs, their_logits = llama_greedy(path, ids, STEPS)
    ours, our_logits = kvq_greedy(Backbone.from_gguf(path), ids, STEPS)
    assert ours == theirs
    assert float(np.abs(their_logits - our_logits).max()) <= 1e-3


@needs_llama
@pytest.mark.usefixtures("int8_activations")
def test_q4_k_m_argmax_agrees_with_llama_cpp(tmp_path: Path) -> None:
    """Q4_K_M (the DeltaNet matrices encoded and computed by kvq's kernels; `attn_qkv` typed
    as llama-quantize types `attn_v`): teacher-forced, both engines read kvq's 16 greedy
    tokens and the argmax of each step is compared; both round activations to 8 bits, not at
    the same places, hence at least 15 of 16 (measured 16 of 16 with seeds 0 and 1)."""
    path = tmp_path / "qwen35moe-q4_k_m.gguf"
    make_tiny(
        path,
        arch="qwen35moe",
        quant="q4_k_m",
        tokenizer="bpe",
        layers=4,
        experts=16,
        hidden=256,
        expert_ffn=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
    )
    types = {t.name: t.tensor_type for t in tensor_map(open_reader(path)).values()}
    assert types["blk.2.attn_qkv.weight"] == Q.Q6_K  # use_more_bits(2, 4), as attn_v
    assert types["blk.0.attn_qkv.weight"] == Q.Q4_K and types["blk.0.ssm_conv1d.weight"] == Q.F32
    bb = Backbone.from_gguf(path)
    assert isinstance(bb.layers[0].attn, DeltaWeights) and isinstance(
        bb.layers[0].attn.wqkv, QMatrix
    )
    ids = load_tokenizer(path).encode(PROMPT)
    ours, _ = kvq_greedy(bb, ids, STEPS)
    llm = llama_model(path)
    llm.eval(ids + ours[:-1])
    theirs = [int(np.argmax(llm.scores[len(ids) - 1 + i])) for i in range(STEPS)]
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert agree >= 15, (ours, theirs)


@pytest.fixture(scope="module")
def bb(path: Path) -> Backbone:
    return Backbone.from_gguf(path)


def _alone(bb: Backbone, chunks: list[list[int]]) -> torch.Tensor:
    cache = bb.new_cache()
    for c in chunks:
        logits = bb.forward([SeqStep(c, cache)])[0]
    return logits


def test_state_sits_beside_the_cache(bb: Backbone) -> None:
    """The DeltaNet layers store no K/V: the cache has rows for the full layers only, and
    a fixed-size state that a pass changes only once it is committed."""
    cache = bb.new_cache()
    assert cache.state is not None and cache.state.layers == [0, 2]
    assert int(cache.k.shape[0]) == 2  # layers 1 and 3
    before = cache.state.ssm.clone()
    bb.forward([SeqStep([1, 2, 3], cache)])
    assert cache.length == 3 and not torch.equal(cache.state.ssm, before)


def test_batched_sequences_and_chunks_equal_each_alone(bb: Backbone) -> None:
    """Two sequences in one pass (one prefilling, one decoding), and a prompt run in chunks,
    give each sequence's logits of a clean pass: each keeps its own recurrent state."""
    a, b = [5, 17, 99, 3, 42, 8, 61], [7, 200, 13]
    ca, cb = bb.new_cache(), bb.new_cache()
    bb.forward([SeqStep(b, cb)])
    both = bb.forward([SeqStep(a, ca), SeqStep([31], cb)])
    torch.testing.assert_close(both[0], _alone(bb, [a]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], _alone(bb, [b, [31]]), rtol=1e-4, atol=1e-4)
    chunks = _alone(bb, [a[:2], a[2:5], a[5:6], a[6:]])
    torch.testing.assert_close(chunks, _alone(bb, [a]), rtol=1e-4, atol=1e-4)


def test_failed_pass_leaves_the_state_for_its_retry(bb: Backbone) -> None:
    """A pass that fails at its last MoE layer (after every DeltaNet layer staged a state)
    advances nothing; the retry and the next step give the logits of passes that never
    failed."""
    cache = bb.new_cache()
    bb.forward([SeqStep([5, 17, 99], cache)])

    def broken(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if layer == 3:
            raise ModelError("worker lost")
        return bb.local_moe(layer, x, ids, w)

    with pytest.raises(ModelError, match="worker lost"):
        bb.forward([SeqStep([3, 42], cache)], moe=broken)
    assert cache.length == 3
    retry = bb.forward([SeqStep([3, 42], cache)])
    torch.testing.assert_close(retry, _alone(bb, [[5, 17, 99], [3, 42]])[None])
    nxt = bb.forward([SeqStep([8], cache)])
    torch.testing.assert_close(nxt, _alone(bb, [[5, 17, 99], [3, 42], [8]])[None])


def test_imrope_equals_ggml_rule_on_text_positions() -> None:
    """IMROPE as ggml's `ggml_mrope_cache_init` assigns pairs to sections, written out as a
    loop: a text token has its position in t, h and w, and 0 in e (not rotated). `Rope`
    computes its angles in float32, as ggml does."""
    dims, base, sections = 16, 1e6, (2, 1, 1, 1)
    rope = Rope(dims, base, "neox", sections=sections)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, dims, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 5, 37])
    got = rope(x, pos)
    total = sum(sections)
    for i, p in enumerate(pos.tolist()):
        for j in range(dims // 2):
            sec = j % total
            r = sec % 3
            text = (
                (r == 0 and sec < 3 * sections[0])
                or (r == 1 and sec < 3 * sections[1])
                or (r == 2 and sec < 3 * sections[2])
            )
            theta = (p if text else 0) * base ** (-2 * j / dims)
            c, s = np.cos(theta), np.sin(theta)
            x0, x1 = x[i, :, j], x[i, :, j + dims // 2]
            torch.testing.assert_close(got[i, :, j], x0 * c - x1 * s, **F32_ANGLES)
            torch.testing.assert_close(got[i, :, j + dims // 2], x1 * c + x0 * s, **F32_ANGLES)


def test_memory_estimate_counts_kv_for_full_layers_and_the_state(path: Path, bb: Backbone) -> None:
    """`kvq model inspect`'s KV bytes: K and V of the full-attention layers only, plus the
    recurrent state of the DeltaNet layers, equal to a cache grown to the whole context."""
    mem = describe_model(path, memory=MemoryAssumptions(n_slots=3, kv_positions=0))["memory"]
    cache = bb.new_cache()
    cache._reserve(bb.meta.context_length)
    assert cache.state is not None
    tensors = (cache.k, cache.v, cache.state.conv, cache.state.ssm)
    assert mem["kv_cache_bytes"] == 3 * sum(t.numel() * t.element_size() for t in tensors)


def test_state_stays_float32_under_bfloat16(path: Path, bb: Backbone) -> None:
    """The recurrent state sums the whole sequence, so it is kept float32 (as llama.cpp keeps
    it) under a bfloat16 compute dtype; the logits of a 30-token prompt then follow float32's
    (measured correlation 0.99960)."""
    ids = [5, 17, 99, 3, 42, 8, 61, 7, 200, 13] * 3
    half = Backbone.from_gguf(path, dtype=torch.bfloat16)
    cache = half.new_cache()
    assert cache.state is not None and cache.state.ssm.dtype == torch.float32
    assert cache.k.dtype == torch.bfloat16
    got = half.forward([SeqStep(ids, cache)])[0].double().numpy()
    want = _alone(bb, [ids]).double().numpy()
    assert np.corrcoef(got, want)[0, 1] >= 0.999
