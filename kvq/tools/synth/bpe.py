"""A small GPT-2-style byte-level BPE vocabulary for synthetic models, written as llama.cpp's
`gpt2` tokenizer (`tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.pre = "gpt-2"`).

Token ids: 0..255 are the 256 byte symbols of GPT-2's `bytes_to_unicode`, in byte order (id b
is byte b, so a byte-level prompt means the same under kvq's byte tokenizer), 256 is BOS and
257 EOS (both CONTROL), then one token per merge learned from `CORPUS`, then UNUSED filler
tokens up to the requested vocabulary size. The merges are learned here, deterministically
(most frequent adjacent pair first, ties to the smaller pair), from text cut by GPT-2's
pre-tokenizer regex, so the same vocabulary comes out of every run and every version.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from gguf import GGUFWriter, TokenType

from kvq.errors import ModelError

PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's split regex
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
N_MERGES = 300
CORPUS = """\
Mixture-of-experts language models route every token to a few experts out of many. The router
scores all of the experts, keeps the top k, and mixes their outputs by weight. The experts of a
layer are independent, so they can live on other machines: the coordinator runs attention and
the router, sends each token's hidden state to the workers that hold its experts, and adds the
results back into the residual stream before the next layer starts.
Workers pull their jobs with blocking reads over Redis streams, so nothing has to connect in to
them, and a worker behind a home router works as well as one in the data center. Each job names
a layer, a slice of experts and the rows of tokens that picked them; the answer is one row per
token, and the coordinator waits for every answer of a layer before it moves on.
Some experts are far more popular than others. A hot expert is kept in fast memory and a cold
one is read from the file when a token needs it, and the counts of every step move experts
between the two. The quick brown fox jumps over the lazy dog, and the lazy dog does not mind.
Numbers such as 12345, 3.14159 and 2024-06-01 appear in text, and so does code like this:
def route(scores, k): return sorted(range(len(scores)), key=scores.__getitem__)[-k:]
"""
# GPT-2's regex ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
# in `re`, exact for the ASCII corpus above; encoding at run time uses the real one
_SPLIT = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


@dataclass(frozen=True, slots=True)
class BpeVocab:
    """A byte-level BPE vocabulary as GGUF stores it."""

    tokens: tuple[str, ...]
    types: tuple[int, ...]  # gguf.TokenType per token
    merges: tuple[str, ...]  # "left right", highest priority first
    bos_id: int
    eos_id: int


def byte_symbols() -> list[str]:
    """GPT-2's `bytes_to_unicode`: the printable character standing for each byte 0..255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


def tiny_vocab(size: int = 0) -> BpeVocab:
    """The built-in vocabulary, padded with UNUSED filler tokens to `size` (0: no padding)."""
    tokens, merges = _learned()
    n = len(tokens)
    if size and size < n:
        raise ModelError(f"vocab size {size} is smaller than the {n} tokens of kvq's tiny BPE")
    fillers = [f"<|filler_{i}|>" for i in range(max(0, size - n))]
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * 2
    types += [TokenType.NORMAL] * (n - 258) + [TokenType.UNUSED] * len(fillers)
    return BpeVocab((*tokens, *fillers), tuple(int(t) for t in types), merges, 256, 257)


def add_vocab(w: GGUFWriter, v: BpeVocab) -> None:
    """The `tokenizer.ggml.*` keys of `v`, as llama.cpp's converter writes a gpt2 vocabulary."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.types))
    w.add_token_merges(list(v.merges))
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(v.eos_id)
    w.add_add_bos_token(True)  # as kvq's byte tokenizer does
    w.add_add_eos_token(False)


@lru_cache(maxsize=1)
def _learned() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens without fillers, merges) learned from CORPUS."""
    tokens = [*byte_symbols(), BOS, EOS]
    known = set(tokens)
    merges = []
    for left, right in train_merges(CORPUS, N_MERGES):
        merges.append(f"{left} {right}")
        if left + right not in known:  # two pairs may spell the same token; keep one id
            known.add(left + right)
            tokens.append(left + right)
    return tuple(tokens), tuple(merges)


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Up to `n_merges` BPE merges of `text`, in learned order."""
    sym = byte_symbols()
    words = Counter(tuple(sym[b] for b in p.encode("utf-8")) for p in _SPLIT.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        best = min(pairs, key=lambda p: (-pairs[p], p), default=None)
        if best is None:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            merged[_merge(word, best)] += count
        words = merged
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
