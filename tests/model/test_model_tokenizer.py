"""ByteTokenizer: UTF-8 bytes plus BOS/EOS, from the model's metadata."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.text import ByteTokenizer


def test_round_trip_and_specials(tiny_path: Path) -> None:
    tok = ByteTokenizer.from_meta(read_meta(tiny_path))
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.encode("A", add_bos=False) == [65]
    assert tok.decode([*ids, tok.eos_id]) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # cut multi-byte sequence is replaced


def test_rejects_other_tokenizers(tiny_path: Path) -> None:
    meta = replace(read_meta(tiny_path), tokenizer_model="gpt2")
    with pytest.raises(ModelError, match="'gpt2'"):
        ByteTokenizer.from_meta(meta)
    with pytest.raises(ModelError, match="bos_id 5"):
        ByteTokenizer(bos_id=5)
