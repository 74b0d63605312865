"""Small real BPE vocabularies, trained here with `tokenizers` and written to GGUF the way
llama.cpp's converter writes Qwen (byte-level `gpt2`) and Mixtral (SentencePiece `llama`) ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

CORPUS = (
    """\
Mixture-of-experts language models route every token to a few experts out of many.
The router scores all experts, keeps the top k, and mixes their outputs by weight.
Workers behind NAT pull their jobs with blocking reads over Redis streams; nothing connects in.
Numbers such as 12345, 3.14159 and 2024-06-01 appear in text, and so does code: def f(x): return x * 2
The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the quick brown fox?
Héllo wörld, ça va? Größe, naïve café, déjà vu. Tabs\tand  double  spaces, new
lines, and more lines.
"""
    * 3
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _merges(tok: Any) -> list[str]:
    raw = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in raw]


def train_byte_level(vocab_size: int = 420) -> Any:
    """A Qwen2-style byte-level BPE with three control tokens at the end of the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


def add_byte_level_vocab(w: GGUFWriter, tok: Any) -> dict[str, int]:
    """Write `tok` as a `gpt2` vocabulary (pre `qwen2`) into `w`; returns the special ids."""
    n = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(n)]
    types = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_merges(tok))
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_add_bos_token(False)
    return ids


def write_byte_level_gguf(path: Path, tok: Any) -> dict[str, int]:
    """A vocabulary-only GGUF of `tok` (see `add_byte_level_vocab`)."""
    w = GGUFWriter(str(path), "qwen3moe")
    ids = add_byte_level_vocab(w, tok)
    _finish(w)
    return ids


def train_sentencepiece(vocab_size: int = 400) -> Any:
    """A SentencePiece-style BPE over U+2581-joined words (no byte pieces: those are added)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=60)
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def write_sentencepiece_gguf(path: Path, tok: Any) -> list[str]:
    """Write `tok` as a `llama` GGUF vocabulary like Mixtral's: <unk>, <s>, </s>, 256 byte
    tokens, then the pieces scored by merge order (earlier merge = higher score)."""
    pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _finish(w)
    return tokens


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
