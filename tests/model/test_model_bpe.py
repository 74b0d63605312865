"""kvq's built-in byte-level BPE (`make_tiny(tokenizer="bpe")`): a GPT-2-style vocabulary that
kvq's loader runs exactly like a `tokenizers.Tokenizer` built from the same vocab and merges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, TokenType

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.text import ByteTokenizer, load_tokenizer
from kvq.tools.synth import make_tiny
from kvq.tools.synth.bpe import BOS, EOS, byte_symbols, tiny_vocab, train_merges

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "experts route tokens; numbers 12345 and 3.14159, dates 2024-06-01",
    "Héllo wörld ✓ 日本語 — naïve café 🙂",
    "line\n\nbreaks\tand tabs  and  doubles ",
    "don't WE'LL they've",
    "  leading spaces",
    "",
]


def _reference(vocab: Any) -> Any:
    """A plain GPT-2 tokenizer: BPE over the same vocab/merges, ByteLevel pre-tokenizer and
    decoder, nothing of kvq's loader."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    tok = Tokenizer(models.BPE(ids, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "bpe.gguf"
    make_tiny(path, tokenizer="bpe", hidden=32, expert_ffn=32, head_dim=8, experts=4)
    return path


def test_vocabulary_layout() -> None:
    v = tiny_vocab()
    sym = byte_symbols()
    assert len(set(sym)) == 256 and sym[ord("A")] == "A" and sym[ord(" ")] == "\u0120"
    assert sym[0] == "\u0100" and sym[ord("\n")] == "\u010a"  # GPT-2's bytes_to_unicode
    assert list(v.tokens[:256]) == sym  # id b is byte b
    assert v.tokens[256:258] == (BOS, EOS) and (v.bos_id, v.eos_id) == (256, 257)
    assert v.types[:258] == (TokenType.NORMAL,) * 256 + (TokenType.CONTROL,) * 2
    assert len(v.merges) == 300 and len(v.tokens) == len(set(v.tokens))
    assert 258 + 250 <= len(v.tokens) <= 258 + 300  # a merge may re-spell an existing token
    for merge in v.merges:
        left, right = merge.split(" ")
        assert left in v.tokens and right in v.tokens and left + right in v.tokens
    assert tiny_vocab() == v  # deterministic
    padded = tiny_vocab(1000)
    assert len(padded.tokens) == 1000 and padded.tokens[: len(v.tokens)] == v.tokens
    assert set(padded.types[len(v.tokens) :]) == {TokenType.UNUSED}
    with pytest.raises(ModelError, match="smaller than the"):
        tiny_vocab(300)


def test_training_merges_the_most_frequent_pair_first() -> None:
    assert train_merges("abab abab aa", 2) == [("a", "b"), ("ab", "ab")]
    # pairs seen once merge too (ties to the smaller pair), until every word is one token
    want = [("x", "y"), ("\u0120", "xy"), ("z", "w"), ("\u0120", "zw")]
    assert train_merges("xy xy xy zw", 10) == want
    assert train_merges("", 5) == []


def test_encodes_like_a_plain_gpt2_tokenizer(bpe_path: Path) -> None:
    ref = _reference(tiny_vocab())
    tok = load_tokenizer(bpe_path)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text).ids, text
        assert tok.decode(ids) == text == ref.decode(ids)
    assert len(tok.encode("the experts", add_bos=False)) == 2  # merges are used
    assert tok.encode("\u00e9", add_bos=False) == list("\u00e9".encode())  # bytes = ids 0..255


def test_file_keys_and_specials(bpe_path: Path) -> None:
    r = GGUFReader(bpe_path)
    assert r.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert r.get_field("tokenizer.ggml.pre").contents() == "gpt-2"  # a name llama.cpp knows
    assert len(r.get_field("tokenizer.ggml.merges").contents()) == 300
    meta = read_meta(bpe_path)
    assert meta.vocab_size == len(tiny_vocab().tokens) and meta.tokenizer_model == "gpt2"
    tok = load_tokenizer(bpe_path)
    assert (tok.bos_id, tok.eos_id) == (256, 257)
    ids = tok.encode("hi")
    assert ids[0] == 256  # add_bos_token = true, as the byte tokenizer does
    assert tok.encode(EOS, add_bos=False) == [257]  # a control token stays whole
    assert tok.decode([256, *ids[1:], 257]) == "hi"


def test_byte_tokenizer_files_still_load(tiny_path: Path) -> None:
    assert isinstance(load_tokenizer(tiny_path), ByteTokenizer)
    assert read_meta(tiny_path).tokenizer_model == "kvq-bytes"
