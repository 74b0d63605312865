"""Tokenizers: `load_tokenizer` picks the one a model carries.

`kvq-bytes` (`make_tiny(tokenizer="bytes")`, older kvq files): kvq's own byte tokenizer, ids
0..255 are bytes, then BOS and EOS; only kvq reads it. Every other GGUF, `make_tiny`'s `bpe`
vocabulary (`kvq.tools.synth.bpe`) included, carries a BPE vocabulary run by
`kvq.text.gguf_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf import reader as gio

BYTE_TOKENIZER = "kvq-bytes"
N_BYTES = 256


def byte_token_list() -> list[str]:
    """The token strings stored in a byte-tokenizer GGUF (BOS = 256, EOS = 257)."""
    return [f"<0x{b:02X}>" for b in range(N_BYTES)] + ["<|bos|>", "<|eos|>"]


class ByteTokenizer:
    """UTF-8 bytes as token ids; special ids (>= 256) are skipped when decoding."""

    def __init__(self, bos_id: int = N_BYTES, eos_id: int = N_BYTES + 1) -> None:
        for label, v in (("bos_id", bos_id), ("eos_id", eos_id)):
            if v < N_BYTES:
                raise ModelError(
                    f"{label} {v} is not a special id; byte tokens use 0..255, so use >= 256"
                )
        self.bos_id = bos_id
        self.eos_id = eos_id

    @classmethod
    def from_meta(cls, meta: ModelMeta) -> ByteTokenizer:
        """The tokenizer of a model whose `tokenizer.ggml.model` is kvq-bytes."""
        if meta.tokenizer_model != BYTE_TOKENIZER:
            raise ModelError(
                f"model tokenizer is {meta.tokenizer_model!r}, not {BYTE_TOKENIZER!r}; "
                "ByteTokenizer only serves models written by kvq.tools.synth.make_tiny"
            )
        if meta.vocab_size < N_BYTES + 2:
            raise ModelError(f"vocab size {meta.vocab_size} is too small for 256 bytes + BOS/EOS")
        return cls(meta.bos_id, meta.eos_id)

    def encode(self, text: str, *, add_bos: bool | None = True) -> list[int]:
        """UTF-8 bytes of `text` as ids, BOS first unless `add_bos` is False."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos is not False else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids (special ids dropped; invalid UTF-8 becomes U+FFFD)."""
        return bytes(i for i in ids if 0 <= i < N_BYTES).decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    """What kvq needs of a tokenizer."""

    bos_id: int
    eos_id: int

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def load_tokenizer(source: ModelMeta | str | Path) -> Tokenizer:
    """The tokenizer of a model: from a GGUF path (any supported tokenizer), or from a
    ModelMeta (only the byte tokenizer; a real vocabulary lives in the file, not the meta)."""
    if isinstance(source, ModelMeta):
        if source.tokenizer_model != BYTE_TOKENIZER:
            raise ModelError(
                f"model {source.name!r} has a {source.tokenizer_model!r} tokenizer whose "
                "vocabulary is in the GGUF file; call load_tokenizer with the file's path"
            )
        return ByteTokenizer.from_meta(source)
    reader = gio.open_reader(source)
    kind = gio.str_field(reader, "tokenizer.ggml.model", "")
    if kind == BYTE_TOKENIZER:
        return ByteTokenizer(
            gio.int_field(reader, "tokenizer.ggml.bos_token_id"),
            gio.int_field(reader, "tokenizer.ggml.eos_token_id"),
        )
    from kvq.text.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(reader, repr(str(source)))
