"""A trained `MoeLM` written as a `qwen3moe` GGUF with its gpt2-BPE vocabulary.

Metadata under the keys llama.cpp's converter writes (`kvq.tools.synth.tiny.add_metadata`),
tensors in llama-quantize's types for the file's type (`kvq.tools.synth.quants.tensor_type`:
norms and the router F32, every other matrix `quant`), no `output.weight` (tied embedding).
The vocabulary: `tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.pre` as the corpus cut it,
`<|endoftext|>` (CONTROL) as BOS and EOS, BOS added.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

from kvq.gguf.arch import arch_spec
from kvq.tools.synth.tiny import add_metadata, write_tensors
from kvq.tools.synth.tiny_weights import TinyConfig
from kvq.tools.train.corpus import END, PRE
from kvq.tools.train.net import MoeLM

ARCH = "qwen3moe"


def tensors(model: MoeLM) -> dict[str, np.ndarray]:
    """GGUF name -> float32 numpy array (numpy layout) of every weight."""
    out = {
        "token_embd.weight": model.token_embd,
        "output_norm.weight": model.output_norm,
    }
    for i, blk in enumerate(model.blocks):
        for name, p in blk.named_parameters():
            out[f"blk.{i}.{name}.weight"] = p
    return {k: v.detach().float().numpy().copy() for k, v in out.items()}


def write_gguf(
    path: Path, model: MoeLM, tokens: list[str], merges: list[str], *, name: str, quant: str
) -> None:
    """Write `model` and its vocabulary to `path` (`quant`: f16 or q8_0 for the matrices)."""
    cfg = model.cfg
    tiny = TinyConfig(
        cfg.layers,
        cfg.experts,
        cfg.experts_used,
        cfg.hidden,
        cfg.expert_ffn,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        vocab=cfg.vocab,
    )
    w = GGUFWriter(str(path), ARCH)
    try:
        add_metadata(
            w,
            tiny,
            arch_spec(ARCH),
            name,
            quant=quant,
            context=cfg.context,
            rope_base=cfg.rope_base,
            rms_eps=cfg.rms_eps,
        )
        _add_vocab(w, tokens, merges)
        write_tensors(w, tensors(model), quant, cfg.layers, cfg.experts)
    finally:
        w.close()


def _add_vocab(w: GGUFWriter, tokens: list[str], merges: list[str]) -> None:
    end = tokens.index(END)
    types = [TokenType.CONTROL if t == END else TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    w.add_bos_token_id(end)
    w.add_eos_token_id(end)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
