"""The trained stdlib pair (`tests/data/stdlib-moe.gguf` and its draft `stdlib-draft.gguf`,
written by `python -m kvq.tools.train.stdlib_pair`): both files small, one vocabulary, kvq's
tokens and logits on held-out text (`stdlib-prompts.json`) those of llama.cpp. The long
checks (perplexity over held-out chunks, greedy runs, n-gram acceptance) are
`python -m kvq.tools.train.check_pair`; their figures are in `stdlib-pair.json`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvq.gguf import reader as gio
from kvq.gguf.meta import read_meta

DATA = Path(__file__).parents[1] / "data"
MAIN, DRAFT = DATA / "stdlib-moe.gguf", DATA / "stdlib-draft.gguf"
VOCAB_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)
F32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache as kvq keeps it


def _prompts() -> list[str]:
    return list(json.loads((DATA / "stdlib-prompts.json").read_text()))


def test_the_pair_is_small_and_shares_one_vocabulary() -> None:
    assert MAIN.stat().st_size + DRAFT.stat().st_size <= 25 * 2**20
    main, draft = read_meta(MAIN), read_meta(DRAFT)
    assert main.arch == draft.arch == "qwen3moe"
    assert main.expert_count >= 8 and main.expert_used_count >= 2
    assert draft.embedding_length < main.embedding_length and draft.block_count < main.block_count
    assert main.vocab_size == draft.vocab_size
    a, b = gio.open_reader(MAIN), gio.open_reader(DRAFT)
    for key in VOCAB_KEYS:
        assert gio.field(a, key) == gio.field(b, key), key
    assert gio.str_field(a, "tokenizer.ggml.model") == "gpt2"


def test_the_record_holds_the_training_and_the_checks() -> None:
    record = json.loads((DATA / "stdlib-pair.json").read_text())
    for which in ("main", "draft"):
        assert record[which]["held_out"]["ppl"] > 1
        assert record[which]["curve"][-1]["loss"] < record[which]["curve"][0]["loss"]
        gap = record["checks"][which]["perplexity"]["relative_gap"]
        assert gap < 0.005, f"{which}: kvq's held-out perplexity is {gap:.2%} off llama.cpp's"


@pytest.fixture(scope="module")
def llama_cpp() -> object:
    return pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("path", [MAIN, DRAFT], ids=["main", "draft"])
def test_kvq_matches_llama_cpp_on_held_out_code(llama_cpp: object, path: Path) -> None:
    """Same token ids, and logits at every position of a held-out snippet as close as the
    two programs' rounding of Q8_0 activations allows (the main model's largest difference
    is 2.3 % of the largest logit): the same top token almost everywhere, the same
    perplexity to 0.5 %."""
    from kvq.model import Backbone, SeqStep
    from kvq.text import load_tokenizer

    llm = llama_cpp.Llama(  # type: ignore[attr-defined]
        model_path=str(path),
        n_ctx=256,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=F32,
        type_v=F32,
    )
    tok = load_tokenizer(path)
    for text in _prompts():
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False)
    ids = tok.encode(_prompts()[0])[:96]
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [T, V]
    bb = Backbone.from_gguf(path)
    ours = bb.forward([SeqStep(ids, bb.new_cache(), verify=True)]).double().numpy()  # [T, V]
    assert np.abs(theirs - ours).max() < 0.05 * np.abs(ours).max()
    assert np.corrcoef(theirs.ravel(), ours.ravel())[0, 1] > 0.999
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() > 0.95
    assert math.isclose(_ppl(ours, ids), _ppl(theirs, ids), rel_tol=0.005)


def _ppl(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under logits [T, V] (row t predicts ids[t + 1])."""
    x = logits[:-1]
    logz = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    return math.exp(float((logz - x[np.arange(len(ids) - 1), ids[1:]]).mean()))
