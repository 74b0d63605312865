"""The training text: the running interpreter's standard library, and its BPE vocabulary.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]` except `site-packages` and the
test suites (`test/`, `*/tests/`, `idlelib/idle_test/`), sorted by relative path. A file is
held out for evaluation when the CRC-32 of its relative path is divisible by `HOLDOUT_MOD`,
so the split depends on the names only, never on the order or the machine.

The tokenizer: byte-level BPE (`tokenizers`' `BpeTrainer`, every byte in the initial
alphabet) over the training files, text cut by kvq's `qwen2` pre-tokenizer regex (the one
llama.cpp runs for `tokenizer.ggml.pre = "qwen2"`), so the vocabulary learned here is cut the
same way by the trainer, by kvq and by llama.cpp. One special token, `<|endoftext|>` (id 0),
is BOS, EOS and the separator between files.
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvq.text.pretokenizers import PRE_TOKENIZERS

PRE = "qwen2"  # tokenizer.ggml.pre
END = "<|endoftext|>"
HOLDOUT_MOD = 20  # about one file in 20 held out
_SKIP_DIRS = ("site-packages", "test", "tests", "idle_test")


@dataclass(frozen=True, slots=True)
class Corpus:
    """The standard library's files, split."""

    root: Path
    train: tuple[str, ...]  # relative paths, sorted
    held_out: tuple[str, ...]

    def text(self, names: tuple[str, ...]) -> list[str]:
        """The files' text (UTF-8, undecodable bytes replaced), in order."""
        return [(self.root / n).read_bytes().decode("utf-8", "replace") for n in names]

    def digest(self) -> str:
        """sha256 over every file's path and bytes: which text a record was trained on."""
        h = hashlib.sha256()
        for n in (*self.train, *self.held_out):
            h.update(n.encode() + b"\0" + (self.root / n).read_bytes())
        return h.hexdigest()


def stdlib_corpus(root: Path | None = None) -> Corpus:
    """The interpreter's standard library (or the tree at `root`), split by name."""
    base = root or Path(sysconfig.get_paths()["stdlib"])
    names = sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*.py")
        if not any(part in _SKIP_DIRS for part in p.relative_to(base).parts[:-1])
    )
    held = tuple(n for n in names if zlib.crc32(n.encode()) % HOLDOUT_MOD == 0)
    train = tuple(n for n in names if zlib.crc32(n.encode()) % HOLDOUT_MOD != 0)
    return Corpus(base, train, held)


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` tokens trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _splits()]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _splits() -> tuple[str, ...]:
    return PRE_TOKENIZERS[PRE].splits


def vocab_lists(tok: Any) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as "left right" in priority order) of a trained tokenizer."""
    import json

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def token_stream(tok: Any, texts: list[str]) -> npt.NDArray[np.uint16]:
    """Every text's token ids, each file followed by `<|endoftext|>` (id 0)."""
    end = tok.token_to_id(END)
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out += [*enc.ids, end]
    return np.asarray(out, dtype=np.uint16)
