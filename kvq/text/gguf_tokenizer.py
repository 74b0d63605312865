"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), run by Hugging Face `tokenizers`.

Two vocabulary kinds cover the models kvq serves, built the way llama.cpp reads them:

- `gpt2`: byte-level BPE with the file's merges, text split by the regexes of its
  pre-tokenizer (`tokenizer.ggml.pre`: qwen2, llama-bpe, deepseek-v3, gpt-4o... every name in
  `kvq.text.pretokenizers`). Qwen, DeepSeek, GLM, Llama-3/4, GPT-OSS models, and
  `make_tiny`'s own vocabulary (`kvq.tools.synth.bpe`).
- `llama`: SentencePiece BPE (Mixtral, Mistral): merges recovered from the token scores (the
  higher the score of the merged piece, the earlier the merge), spaces as U+2581, a space
  prefix, and byte fallback (`<0xNN>` tokens) for characters outside the vocabulary.

Tokens typed CONTROL (e.g. `<|im_end|>`) are matched whole and dropped when decoding;
USER_DEFINED ones are matched whole and kept. Types are corrected by token text as llama.cpp
does (`llama_token_types`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gguf import GGUFReader

from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.text.pretokenizers import PRE_TOKENIZERS, PreTokenizer

_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
_SPACE = "\u2581"
# llama.cpp ends generation on these by name, and makes each a control token if the file did not
_END_OF_GENERATION = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
    "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> "
    "<eos> <turn|> <|tool_response> <\uff5cend\u2581of\u2581sentence\uff5c> [e~[".split()
)
# harmony's (gpt-oss) structure tokens: llama.cpp keeps them in decoded text, so must kvq
_HARMONY_VISIBLE = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


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
    types = llama_token_types(
        tokens, gio.field(reader, "tokenizer.ggml.token_type", [], required=False)
    )
    if kind == "gpt2":
        pre = pre_tokenizer(reader, label)
        backend = _byte_level(reader, tokens, pre, label)
        add_bos_default = pre.add_bos
    elif kind == "llama":
        backend = _sentencepiece(reader, tokens, types, label)
        add_bos_default = True
    else:
        raise ModelError(
            f"{label} has tokenizer model {kind!r}; kvq runs 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE) and 'kvq-bytes'"
        )
    _add_special(backend, tokens, types, gio.str_field(reader, "general.name", ""))
    return GGUFTokenizer(
        backend,
        bos_id=gio.int_field(reader, "tokenizer.ggml.bos_token_id", -1),
        eos_id=gio.int_field(reader, "tokenizer.ggml.eos_token_id", -1),
        add_bos=gio.bool_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default),
    )


def pre_tokenizer(reader: GGUFReader, label: str) -> PreTokenizer:
    """The file's `tokenizer.ggml.pre` (llama.cpp's "default" when absent); ModelError names
    an unknown one."""
    name = gio.str_field(reader, "tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise ModelError(
            f"{label} has pre-tokenizer {name!r}; kvq knows {sorted(PRE_TOKENIZERS)} "
            "(the split regexes decide how text is cut before BPE)"
        )
    return PRE_TOKENIZERS[name]


def llama_token_types(tokens: Sequence[str], types: Sequence[int]) -> list[int]:
    """The file's token types with llama.cpp's corrections by token text: end-of-generation
    tokens are control tokens, harmony's structure tokens are user-defined (shown when decoded),
    and so is `<|end|>` where `<|return|>` and `<|call|>` end generation instead (gpt-oss)."""
    out = [*types, *[_NORMAL] * (len(tokens) - len(types))]
    for i, t in enumerate(tokens):
        if t in _END_OF_GENERATION:
            out[i] = _CONTROL
        if t in _HARMONY_VISIBLE:
            out[i] = _USER_DEFINED
    present = set(tokens)
    if "<|end|>" in present and (
        {"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present
    ):
        out[tokens.index("<|end|>")] = _USER_DEFINED
    return out


def _byte_level(reader: GGUFReader, tokens: list[str], pre: PreTokenizer, label: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges: list[str] = gio.field(reader, "tokenizer.ggml.merges", None, required=False)
    if merges is None:
        raise ModelError(f"{label} has a byte-level vocabulary without tokenizer.ggml.merges")
    pairs = [_merge_pair(m, label) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
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


def _add_special(backend: Any, tokens: list[str], types: list[int], model_name: str) -> None:
    """Match CONTROL and USER_DEFINED tokens whole (CONTROL ones are skipped in decoding).
    Phi-3's special tokens swallow the whitespace after them, as llama.cpp sets by model name."""
    from tokenizers import AddedToken

    phi3 = any(n in model_name.lower() for n in ("phi-3", "phi3"))

    def added(t: str, special: bool) -> Any:
        rstrip = phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")
        return AddedToken(t, special=special, normalized=False, rstrip=rstrip)

    control = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL]
    user = [t for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens([added(t, True) for t in control])
    if user:
        backend.add_tokens([added(t, False) for t in user])
