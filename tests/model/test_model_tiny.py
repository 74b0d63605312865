"""make_tiny: per-tensor types as llama-quantize gives them (fallbacks, the Q4_K_M mix), the
BPE tokenizer option, and agreement with the preset planner's tensor list."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from gguf import GGUFReader, LlamaFileType

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf import reader as gio
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.text import load_tokenizer
from kvq.tools.synth.bpe import tiny_vocab
from kvq.tools.synth.presets import Preset, plan
from kvq.tools.synth.quants import tensor_type
from kvq.tools.synth.tiny import TinyConfig, make_tiny, write_tiny


def _types(path: Path) -> dict[str, str]:
    return {t.name: gio.quant_type(int(t.tensor_type)).name for t in GGUFReader(path).tensors}


def test_k_quants_with_the_default_sizes_fall_back_per_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q4k.gguf"
    make_tiny(path, quant="q4_k")  # hidden 64, expert ffn 64: no whole 256-blocks anywhere
    types = _types(path)
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q5_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == "F32"
    bb = Backbone.from_gguf(path)
    assert len(generate(bb, [256, 104, 105], 4, stop_at_eos=False)) == 4


def test_q4_k_m_mix_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mix.gguf"
    make_tiny(
        path,
        quant="q4_k_m",
        layers=4,
        experts=4,
        hidden=256,
        expert_ffn=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        tokenizer="bpe",
    )
    types = _types(path)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # use_more_bits(i, 4): layers 2 and 3
    more_bits = ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == more_bits
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == more_bits
    assert Counter(types[f"blk.{i}.ffn_up_exps.weight"] for i in range(4)) == {"Q4_K": 4}
    reader = GGUFReader(path)
    assert reader.get_field("general.file_type").contents() == LlamaFileType.MOSTLY_Q4_K_M
    bb = Backbone.from_gguf(path)
    ids = load_tokenizer(path).encode("The experts")
    assert len(generate(bb, ids, 3, stop_at_eos=False)) == 3


@pytest.mark.parametrize(
    ("arch", "quant"), [("qwen2moe", "q4_k_m"), ("mixtral", "q5_0"), ("qwen3moe", "f16")]
)
def test_the_planner_lists_what_make_tiny_writes(tmp_path: Path, arch: str, quant: str) -> None:
    path = tmp_path / "t.gguf"
    make_tiny(
        path,
        arch=arch,
        quant=quant,
        tokenizer="bpe",
        hidden=256,
        expert_ffn=96,
        shared_expert_ffn=64,
    )
    meta = read_meta(path)
    cfg = TinyConfig(2, 8, 2, 256, 96, 4, 2, 16, 64, vocab=meta.vocab_size)
    gguf_arch = {"mixtral": "llama"}.get(arch, arch)
    want = plan(Preset("t", cfg, 512, 1e6, 1e-6, gguf_arch), quant)
    got = [
        (t.name, gio.numpy_shape(t), int(t.tensor_type), int(t.n_bytes))
        for t in GGUFReader(path).tensors
    ]
    assert got == [(t.name, t.shape, int(t.qtype), t.nbytes) for t in want]


def test_bpe_tokenizer_sets_and_pads_the_vocab(tmp_path: Path) -> None:
    path = tmp_path / "bpe.gguf"
    make_tiny(path, tokenizer="bpe")
    assert read_meta(path).vocab_size == len(tiny_vocab().tokens)
    cfg = TinyConfig(1, 4, 2, 32, 32, 4, 2, 8, vocab=700)
    write_tiny(tmp_path / "pad.gguf", cfg, tokenizer="bpe")
    assert read_meta(tmp_path / "pad.gguf").vocab_size == 700
    with pytest.raises(ModelError, match="does not fit the byte tokenizer"):
        write_tiny(tmp_path / "x.gguf", cfg, tokenizer="bytes")
    with pytest.raises(ModelError, match="tokenizer 'wordpiece' is unknown"):
        make_tiny(tmp_path / "x.gguf", tokenizer="wordpiece")
    with pytest.raises(ModelError, match="'q3_k' is not supported"):
        make_tiny(tmp_path / "x.gguf", quant="q3_k")
    assert tensor_type("token_embd.weight", (700, 32), "q4_k", 1, 4).name == "Q5_0"
