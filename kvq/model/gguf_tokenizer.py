"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), run by Hugging Face `tokenizers`.

Two vocabulary kinds cover the models kvq serves, built the way llama.cpp reads them:

- `gpt2`: byte-level BPE with the file's merges, text split by the regex of its pre-tokenizer
  (`tokenizer.ggml.pre`: qwen2, llama-bpe, gpt-2...). Qwen1.5/2/3 models, and `make_tiny`'s
  own vocabulary (`kvq.model.bpe`).
- `llama`: SentencePiece BPE (Mixtral, Mistral): merges recovered from the token scores (the
  higher the score of the merged piece, the earlier the merge), spaces as U+2581, a space
  prefix, and byte fallback (`<0xNN>` tokens) for characters outside the vocabulary.

Tokens typed CONTROL (e.g. `<|im_end|>`) are matched whole and dropped when decoding;
USER_DEFINED ones are matched whole and kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gguf import GGUFReader

from kvq.errors import ModelError
from kvq.model import gguf_io as gio

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex or None for GPT-2's own, ignore_merges as llama.cpp does)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "gpt-2": (None, False),  # llama.cpp's name for GPT-2's regex (what make_tiny writes)
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, True),
}
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6
_SPACE = "\u2581"


class GGUFTokenizer:
    """encode/decode with a `tokenizers.Tokenizer` built from a GGUF's vocabulary."""

    def __init__(self, backend: Any, bos_id: int, eos_id: int, add_bos: bool) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos and bos_id >= 0

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, BOS first when the model asks for it (or `add_bos` says so)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos and self.bos_id >= 0
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, control tokens dropped."""
        return str(self.backend.decode(list(ids), skip_special_tokens=True))


def gguf_tokenizer(reader: GGUFReader, label: str) -> GGUFTokenizer:
    """The tokenizer of an open GGUF (`label` names the file in errors)."""
    try:
        import tokenizers  # noqa: F401  (an optional dependency: say how to get it)
    except ImportError as exc:
        raise ModelError(
            f"{label} carries a {gio.str_field(reader, 'tokenizer.ggml.model')!r} tokenizer; "
            "running it needs the `tokenizers` package: pip install tokenizers"
        ) from exc
    kind = gio.str_field(reader, "tokenizer.ggml.model")
    tokens: list[str] = gio.field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gio.field(reader, "tokenizer.ggml.token_type", [], required=False)
    if kind == "gpt2":
        backend = _byte_level(reader, tokens, label)
    elif kind == "llama":
        backend = _sentencepiece(reader, tokens, types, label)
    else:
        raise ModelError(
            f"{label} has tokenizer model {kind!r}; kvq runs 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE) and 'kvq-bytes'"
        )
    _add_special(backend, tokens, types)
    return GGUFTokenizer(
        backend,
        bos_id=gio.int_field(reader, "tokenizer.ggml.bos_token_id", -1),
        eos_id=gio.int_field(reader, "tokenizer.ggml.eos_token_id", -1),
        add_bos=gio.bool_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"),
    )


def _byte_level(reader: GGUFReader, tokens: list[str], label: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = gio.str_field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelError(
            f"{label} has pre-tokenizer {pre!r}; kvq knows {sorted(PRE_TOKENIZERS)} "
            "(the split regex decides how text is cut before BPE)"
        )
    split, ignore_merges = PRE_TOKENIZERS[pre]
    merges: list[str] = gio.field(reader, "tokenizer.ggml.merges")
    pairs = [_merge_pair(m, label) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(merge: str, label: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ModelError(f"{label} has a malformed BPE merge {merge!r}; expected 'left right'")
    return left, right


def _sentencepiece(reader: GGUFReader, tokens: list[str], types: list[int], label: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores: list[float] = gio.field(reader, "tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise ModelError(f"{label} has {len(scores)} token scores for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = gio.int_field(reader, "tokenizer.ggml.unknown_token_id", 0)
    special = {t for t, k in zip(tokens, types, strict=False) if k in (_CONTROL, _BYTE)}
    pairs = _merges_from_scores(vocab, scores, special)
    tok = Tokenizer(
        models.BPE(vocab, pairs, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True)
    )
    prefix = gio.bool_field(reader, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Replace(" ", _SPACE)]
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE), *steps] if prefix else steps
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tok


def _merges_from_scores(
    vocab: dict[str, int], scores: Sequence[float], skip: set[str]
) -> list[tuple[str, str]]:
    """Every (left, right) split of each piece whose halves are pieces, best merged score
    first: SentencePiece merges the adjacent pair whose union scores highest."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, idx in vocab.items():
        if piece in skip:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab and left not in skip and right not in skip:
                found.append((-scores[idx], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special(backend: Any, tokens: list[str], types: list[int]) -> None:
    """Match CONTROL and USER_DEFINED tokens whole (CONTROL ones are skipped in decoding)."""
    from tokenizers import AddedToken

    control = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL]
    user = [t for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
