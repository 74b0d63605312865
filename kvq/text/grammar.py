"""Constrained decoding: a grammar per sequence masks the logits so that only the tokens it
allows can be sampled (JSON schemas, Lark or GBNF grammars, regexes), by llguidance over the
model's own vocabulary.

`compile_grammar` turns what a client asked for into llguidance's grammar text (checked, so
a bad schema is refused before anything is queued); `GrammarVocab` is the model's vocabulary
as llguidance reads it (built once per tokenizer: its token bytes, its control tokens marked
special so that text never matches them); `Constraint` is one sequence's matcher, and
`mask_rows` applies the masks of a batch's constrained rows in one parallel call.
The grammar is never a retry: a sequence cannot leave it, and once it is complete only EOS
is allowed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvq.errors import ModelError

KINDS = ("json_schema", "lark", "gbnf", "regex", "choice")
# JSON without free whitespace: what `strict` answers look like, and random weights cannot
# wander through endless blank lines
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise ModelError(
            "constrained decoding (response_format, grammar, tools with tool_choice) needs "
            "llguidance: pip install 'kvq[grammar]'"
        ) from exc
    return llguidance


def available() -> bool:
    """Whether llguidance is installed here."""
    try:
        _llg()
    except ModelError:
        return False
    return True


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for `text` of `kind` (one of KINDS; a JSON schema as JSON text);
    ModelError saying what is wrong with it."""
    llg = _llg()
    if kind not in KINDS:
        raise ModelError(f"grammar kind {kind!r} is not one of {', '.join(KINDS)}")
    try:
        if kind == "json_schema":
            import json

            schema = json.loads(text)
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": COMPACT}
            grammar = str(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        else:
            grammar = str(llg.grammar_from("grammar" if kind == "gbnf" else kind, text))
    except (ValueError, TypeError) as exc:
        raise ModelError(f"the {kind} does not compile: {exc}") from None
    problem = str(llg.LLMatcher.validate_grammar(grammar, None))
    if problem:
        raise ModelError(f"the {kind} does not compile: {problem.strip()}")
    return grammar


def lark_string(s: str) -> str:
    """`s` as a Lark string literal."""
    import json

    return json.dumps(s)


class GrammarVocab:
    """A model's vocabulary as llguidance reads it, and the executor of batched masks."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        llg = _llg()
        self.vocab_size = vocab_size
        backend = getattr(tokenizer, "backend", None)
        if backend is not None:  # a GGUF vocabulary run by `tokenizers`: its own JSON
            self.ll = llg.LLTokenizer(backend.to_str(), eos_token=tokenizer.eos_id)
        else:  # kvq's byte tokenizer
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer)))
        self.executor = llg.LLExecutor()
        self.words = (self.ll.vocab_size + 31) // 32

    def matcher(self, grammar: str) -> Constraint:
        """A fresh matcher of `grammar` over this vocabulary; ModelError if it is bad."""
        m = _llg().LLMatcher(self.ll, grammar)
        if m.is_error():
            raise ModelError(f"the grammar does not compile: {m.get_error()}")
        return Constraint(m)


class _ByteVocab:
    """kvq's byte tokenizer as llguidance's TokenizerWrapper wants it."""

    def __init__(self, tok: Any) -> None:
        n = max(tok.bos_id, tok.eos_id) + 1
        self.tokens = [bytes([i]) if i < 256 else b"\xff<|special_%d|>" % i for i in range(n)]
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.special_token_ids = list(range(256, n))

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


class Constraint:
    """One sequence's grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def accept(self, token: int) -> None:
        """Advance past `token` (one the mask allowed; ModelError otherwise)."""
        if not self.m.consume_token(token):
            raise ModelError(f"token {token} is outside the grammar: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return bool(self.m.is_stopped())


def mask_rows(
    vocab: GrammarVocab, logits: torch.Tensor, rows: list[tuple[int, Constraint]]
) -> None:
    """Set to -inf, in place, the logits [S, V] of tokens each row's grammar forbids."""
    if not rows:
        return
    bits = np.zeros((len(rows), vocab.words), dtype=np.int32)  # [R, V/32]
    vocab.executor.unsafe_compute_mask_ptr(
        [(c.m, j) for j, (_, c) in enumerate(rows)], bits.ctypes.data, vocab.words * 4, len(rows)
    )
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")  # [R, 32 * words]
    v = logits.shape[1]
    keep = np.zeros((len(rows), v), dtype=bool)
    n = min(v, allowed.shape[1])
    keep[:, :n] = allowed[:, :n].astype(bool)
    idx = torch.tensor([i for i, _ in rows])
    logits[idx] = logits[idx].masked_fill(~torch.from_numpy(keep), float("-inf"))
