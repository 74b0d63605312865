"""llama.cpp itself (llama-cpp-python, the optional `bench` extra) opens make_tiny and preset
files: same token ids as kvq's loader, and the same logits (fp32 files to 1e-3 relative;
quantized ones only correlate, since llama.cpp rounds activations to 8 bits and a near tie in
the router can then pick another expert). Skipped where llama_cpp is not installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvq.model import Backbone, SeqStep  # noqa: E402
from kvq.text import load_tokenizer  # noqa: E402
from kvq.tools.synth import make_tiny  # noqa: E402
from kvq.tools.synth.presets import Preset, write_preset  # noqa: E402
from kvq.tools.synth.tiny import TinyConfig  # noqa: E402

TEXTS = ["The quick brown fox jumps", "Héllo wörld ✓ 日本語", "experts route 12345 tokens"]
DIMS = {"layers": 2, "experts": 4, "hidden": 256, "expert_ffn": 256, "head_dim": 64}


def _compare(path: Path, tol: float | None) -> None:
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2
    )
    tok = load_tokenizer(path)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == tok.encode(text)
    ids = tok.encode(TEXTS[0])
    llm.eval(ids)
    theirs = np.asarray(llm.scores[len(ids) - 1], dtype=np.float64)  # [V]
    bb = Backbone.from_gguf(path)
    ours = bb.forward([SeqStep(ids, bb.new_cache())])[0].double().numpy()  # [V]
    assert np.isfinite(theirs).all()
    if tol is None:
        assert np.corrcoef(theirs, ours)[0, 1] > 0.98
    else:
        assert np.abs(theirs - ours).max() / np.abs(ours).max() < tol
        assert theirs.argmax() == ours.argmax()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_fp32_files_match_llama_cpp(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    make_tiny(path, arch=arch, tokenizer="bpe", **DIMS)  # type: ignore[arg-type]
    _compare(path, 1e-3)


@pytest.mark.parametrize("quant", ["q4_k_m", "q4_k"])
def test_quantized_files_load_in_llama_cpp(tmp_path: Path, quant: str) -> None:
    path = tmp_path / f"{quant}.gguf"
    make_tiny(path, quant=quant, tokenizer="bpe")  # default dims: Q5_0 fallbacks
    _compare(path, None)


def test_preset_files_load_in_llama_cpp(tmp_path: Path) -> None:
    path = tmp_path / "preset.gguf"
    cfg = TinyConfig(4, 16, 4, 512, 256, 4, 2, 64, vocab=1000)
    write_preset(path, Preset("small", cfg, 256, 1e6, 1e-6))
    _compare(path, None)
