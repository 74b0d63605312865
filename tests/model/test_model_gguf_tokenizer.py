"""Tokenizers carried by GGUF files (`tokenizer.ggml.*`), run through `tokenizers`.

References: the byte-level vocabulary must encode exactly like the `tokenizers` object it was
trained as; both kinds must encode like transformers' own GGUF tokenizer converter.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter

pytest.importorskip("tokenizers")

import tokenizer_fixtures as fx

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.text import ByteTokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "numbers 12345 and 3.14159, dates 2024-06-01",
    "Héllo wörld ✓ 日本語 — naïve café",
    "line\n\nbreaks\tand tabs  and  doubles ",
    "don't WE'LL they've",
    "def f(x): return x * 2",
]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, int]]:
    tok = fx.train_byte_level()
    path = tmp_path_factory.mktemp("tok") / "qwen-vocab.gguf"
    return path, tok, fx.write_byte_level_gguf(path, tok)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "mixtral-vocab.gguf"
    fx.write_sentencepiece_gguf(path, fx.train_sentencepiece())
    return path


def _transformers_tokenizer(path: Path) -> Any:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    return convert_gguf_tokenizer(arch, tokenizer_dict)[0]


def test_byte_level_encodes_like_the_trained_tokenizer(byte_level: Any) -> None:
    path, trained, specials = byte_level
    tok = load_tokenizer(path)
    for text in [*TEXTS, "<|im_start|>user\nhi there<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == trained.encode(text).ids
        assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.encode("<|im_end|>") == [specials["<|im_end|>"]]  # a control token stays whole
    assert (tok.bos_id, tok.eos_id) == (specials["<|endoftext|>"], specials["<|im_end|>"])
    assert tok.encode("hi")[0] != tok.bos_id  # add_bos_token = false, as Qwen files say


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_both_kinds_encode_like_transformers_gguf_converter(
    byte_level: Any, sentencepiece: Path
) -> None:
    for path in (byte_level[0], sentencepiece):
        ref = _transformers_tokenizer(path)
        tok = load_tokenizer(path)
        for text in TEXTS:  # none starts with a space: see the next test
            assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids


def test_sentencepiece_follows_llama_cpp(sentencepiece: Path) -> None:
    tok = load_tokenizer(sentencepiece)
    vocab = fx.write_sentencepiece_gguf(
        sentencepiece.with_name("again.gguf"), fx.train_sentencepiece()
    )
    ids = tok.encode("Héllo wörld ✓")
    assert ids[0] == tok.bos_id == 1  # llama vocabularies add BOS unless the file says not
    pieces = [vocab[i] for i in ids[1:]]
    assert pieces[0].startswith("\u2581")  # the space prefix
    assert pieces[-3:] == ["<0xE2>", "<0x9C>", "<0x93>"]  # byte fallback for a missing char
    assert tok.decode(ids) == "Héllo wörld ✓"
    # llama.cpp prefixes one space, then turns every space into U+2581 (3 here, not 2)
    lead = "".join(vocab[i] for i in tok.encode("  leading", add_bos=False))
    assert lead.startswith("\u2581\u2581\u2581l")
    assert tok.decode(tok.encode("  leading")) == "  leading"


def test_byte_models_and_meta(tiny_path: Path) -> None:
    tok = load_tokenizer(tiny_path)
    assert isinstance(tok, ByteTokenizer) and tok.encode("A") == [256, 65]
    assert isinstance(load_tokenizer(read_meta(tiny_path)), ByteTokenizer)


def _vocab_file(path: Path, model: str, pre: str | None = None) -> Path:
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    fx._finish(w)
    return path


def test_refusals(
    byte_level: Any, tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = replace(read_meta(tiny_path), tokenizer_model="gpt2")
    with pytest.raises(ModelError, match="'gpt2' tokenizer whose vocabulary is in the GGUF"):
        load_tokenizer(meta)
    with pytest.raises(ModelError, match="tokenizer model 'bert'; kvq runs 'gpt2'"):
        load_tokenizer(_vocab_file(tmp_path / "bert.gguf", "bert"))
    for unknown in ("superbpe", "gemma4", "no-such-pre"):  # llama.cpp knows the first two
        with pytest.raises(ModelError, match=f"pre-tokenizer '{unknown}'; kvq knows"):
            load_tokenizer(_vocab_file(tmp_path / "pre.gguf", "gpt2", unknown))
    assert load_tokenizer(_vocab_file(tmp_path / "ok.gguf", "gpt2")).encode("ab") == [2]
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ModelError, match="pip install tokenizers"):
        load_tokenizer(byte_level[0])


def test_token_types_corrected_by_text_as_llama_cpp_does() -> None:
    from kvq.text.gguf_tokenizer import llama_token_types

    normal, control, user = 1, 3, 4
    harmony = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    assert llama_token_types(harmony, [control] * 6) == [user, user, user, user, control, control]
    # <|end|> ends generation unless <|return|> and <|call|> do; a NORMAL <|im_end|> is control
    assert llama_token_types(["<|end|>", "<|im_end|>", "hi"], [normal] * 3) == [
        control,
        control,
        normal,
    ]
    assert llama_token_types(["a", "b"], []) == [normal, normal]  # no types: all normal
