"""Presets: real-sized random models. The writing path runs on a scaled-down preset (the same
code, small dims); the real presets are checked for their sizes only (they are GBs)."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf import reader as gio
from kvq.model import Backbone, SeqStep
from kvq.model.generate import generate
from kvq.text import load_tokenizer
from kvq.tools.synth.presets import PRESETS, Preset, plan, preset_named, write_preset
from kvq.tools.synth.tiny import TinyConfig

SMALL = Preset("small", TinyConfig(4, 16, 4, 512, 256, 4, 2, 64, vocab=1000), 256, 1e6, 1e-6)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("preset") / "small.gguf"
    write_preset(path, SMALL, "q4_k_m", seed=3)
    return path


def test_small_preset_file_follows_the_plan(small: Path) -> None:
    got = [
        (t.name, gio.numpy_shape(t), int(t.tensor_type), int(t.n_bytes))
        for t in GGUFReader(small).tensors
    ]
    assert got == [(t.name, t.shape, int(t.qtype), t.nbytes) for t in plan(SMALL)]
    types = {name: gio.quant_type(qtype).name for name, _, qtype, _ in got}
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == [
        "Q4_K",
        "Q4_K",
        "Q6_K",
        "Q6_K",
    ]
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    meta = read_meta(small)
    assert (meta.block_count, meta.expert_count, meta.expert_used_count) == (4, 16, 4)
    assert (meta.vocab_size, meta.context_length, meta.head_dim) == (1000, 256, 64)
    assert meta.name == "kvq-small-random-s3"


def test_small_preset_runs_with_bounded_activations_and_skewed_routing(small: Path) -> None:
    bb = Backbone.from_gguf(small)
    tok = load_tokenizer(small)
    ids = tok.encode("Some experts are far more popular than others, and the router knows it.")
    picks: dict[int, Counter[int]] = {}

    def moe(layer: int, x: torch.Tensor, top: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        picks.setdefault(layer, Counter()).update(top.flatten().tolist())
        return bb.local_moe(layer, x, top, w)

    logits = bb.forward([SeqStep(ids, bb.new_cache())], moe=moe)
    assert torch.isfinite(logits).all() and 0.5 < float(logits.std()) < 10
    for layer, counts in picks.items():
        top_share = counts.most_common(1)[0][1] / len(ids)
        assert top_share > 0.9, (layer, counts)  # one expert in (nearly) every token's top-4
        assert len(counts) < 16  # some experts are never picked for this text
    assert len(generate(bb, ids[:4], 6, stop_at_eos=False)) == 6


def test_writing_streams_tensor_by_tensor(tmp_path: Path) -> None:
    p = Preset("mid", TinyConfig(3, 32, 4, 512, 512, 4, 2, 64, vocab=600), 128, 1e6, 1e-6)
    tensors = plan(p, "q8_0")
    total, largest = sum(t.nbytes for t in tensors), max(t.nbytes for t in tensors)
    tracemalloc.start()
    try:
        write_preset(tmp_path / "mid.gguf", p, "q8_0")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total > 50e6 and peak < 4 * largest < total / 2
    assert (tmp_path / "mid.gguf").stat().st_size > total


def test_same_seed_same_file(tmp_path: Path) -> None:
    p = Preset("x", TinyConfig(1, 4, 2, 64, 64, 4, 2, 16, vocab=600), 128, 1e6, 1e-6)
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        write_preset(tmp_path / f"{name}.gguf", p, "q4_k", seed)
    a, b, c = ((tmp_path / f"{n}.gguf").read_bytes() for n in "abc")
    assert a == b and a != c
    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "a.gguf").tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "Q5_0"  # hidden 64: Q4_K falls back


@pytest.mark.parametrize(
    ("name", "params", "gib", "expert_share"),
    [("olmoe-1b-7b", 6.92e9, 3.92, 0.92), ("qwen3-30b-a3b", 30.53e9, 17.28, 0.94)],
)
def test_real_preset_sizes(name: str, params: float, gib: float, expert_share: float) -> None:
    tensors = plan(preset_named(name))
    total = sum(t.nbytes for t in tensors)
    experts = sum(t.nbytes for t in tensors if "_exps." in t.name)
    assert sum(int(np.prod(t.shape)) for t in tensors) == pytest.approx(params, rel=1e-3)
    assert total / 2**30 == pytest.approx(gib, abs=0.01)  # Q4_K_M, as llama.cpp's files
    assert experts / total == pytest.approx(expert_share, abs=0.01)
    cfg = PRESETS[name].cfg
    emb = next(t for t in tensors if t.name == "token_embd.weight")
    assert emb.shape == (cfg.vocab, 2048) and emb.qtype.name == "Q4_K"
    assert Counter(t.qtype.name for t in tensors if "ffn_down_exps" in t.name)["Q6_K"] == (
        cfg.layers // 2
    )
    with pytest.raises(ModelError, match="preset 'llama-70b' is unknown"):
        preset_named("llama-70b")


DEEPSEEK = Preset(
    "ds",
    TinyConfig(
        3,
        8,
        2,
        256,
        256,
        4,
        4,
        96,
        vocab=1000,
        dense_layers=1,
        dense_ffn=512,
        shared_count=2,
        rope_dim=32,
        kv_lora_rank=64,
        v_head_dim=64,
        gating="softmax",
        weights_norm=False,
        weights_scale=1.0,
    ),
    256,
    1e4,
    1e-6,
    arch="deepseek2",
    yarn=(4.0, 64, 0.0707),
)


def test_deepseek2_preset_carries_its_parts_and_generates(tmp_path: Path) -> None:
    """The deepseek-v2-lite preset's writing path, scaled down: MLA without q LoRA, a dense
    first layer, two shared experts, YaRN; kvq generates from it (and llama.cpp agrees on the
    logits where it is installed)."""
    path = tmp_path / "ds.gguf"
    write_preset(path, DEEPSEEK, "q4_k_m", seed=1)
    m = read_meta(path)
    assert (m.arch, m.leading_dense_block_count, list(m.moe_layers)) == ("deepseek2", 1, [1, 2])
    assert (m.q_lora_rank, m.kv_lora_rank, m.rope_dims, m.value_head_dim) == (0, 64, 32, 64)
    assert (m.rope_scaling_type, m.rope_scaling_factor, m.rope_yarn_log_mul) == (
        "yarn",
        4.0,
        pytest.approx(0.0707),
    )
    assert m.expert_shared_feed_forward_length == 2 * 256
    bb = Backbone.from_gguf(path)
    ids = load_tokenizer(path).encode("experts route tokens")
    logits = bb.forward([SeqStep(ids, bb.new_cache())])[0]
    assert torch.isfinite(logits).all()
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=64,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=0,
        type_v=0,
    )
    llm.eval(ids)
    theirs = np.asarray(llm.scores[len(ids) - 1], dtype=np.float64)
    assert np.corrcoef(theirs, logits.double().numpy())[0, 1] > 0.98


@pytest.mark.parametrize(
    "arch", ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "glm4moe", "deepseek2", "llama4"]
)
def test_preset_shapes_are_what_make_tiny_writes(arch: str) -> None:
    """One description of every family's tensors (`layer_shapes`): the presets' plan and the
    tiny writer's arrays agree name for name and shape for shape."""
    from kvq.gguf.arch import tiny_arch
    from kvq.tools.synth.presets import tensor_shapes
    from kvq.tools.synth.tiny import family_parts
    from kvq.tools.synth.tiny_weights import tiny_tensors

    cfg = family_parts(TinyConfig(3, 8, 2, 64, 32, 4, 2, 16, shared_expert_ffn=40), arch)
    spec = tiny_arch(arch)
    arrays = tiny_tensors(cfg, spec, np.random.default_rng(0))
    assert {k: v.shape for k, v in arrays.items()} == tensor_shapes(cfg, spec)


def test_deepseek_v2_lite_preset_size() -> None:
    """DeepSeek-V2-Lite's 15.7 B parameters; expert rows of 1408 are not whole 256-blocks, so
    Q4_K_M's Q4_K / Q6_K fall back to Q5_0 / Q8_0 there, as llama-quantize does."""
    tensors = plan(preset_named("deepseek-v2-lite"))
    assert sum(int(np.prod(t.shape)) for t in tensors) == pytest.approx(15.706e9, rel=1e-3)
    assert sum(t.nbytes for t in tensors) / 2**30 == pytest.approx(9.65, abs=0.01)
    downs = Counter(t.qtype.name for t in tensors if "ffn_down_exps" in t.name)
    assert downs == {"Q5_0": 14, "Q8_0": 12}
    assert not any(t.name.startswith("blk.0.") and "_exps." in t.name for t in tensors)
