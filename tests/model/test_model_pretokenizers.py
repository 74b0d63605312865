"""Every pre-tokenizer kvq knows, against llama.cpp's own tokenizer.

For each `tokenizer.ggml.pre` name, a byte-level BPE is trained on `pretok_fixtures.CASES` cut
by that name's regexes, written as a vocabulary-only GGUF (with whole pieces no merge reaches,
the families' special tokens, and no add_bos key, so llama.cpp's default per name decides), and
llama.cpp (`llama_cpp.Llama(vocab_only=True)`) must give the same ids for every case, BOS and
special tokens included, and the same text back. Skipped where llama_cpp is not importable.

llama.cpp's source tree (`--llama-cpp-src`, by default `.tools/llama.cpp`, where `.ci/run` unpacks
the vocabularies that llama-cpp-python's sdist carries) adds its real vocabularies: its expected
ids (`models/ggml-vocab-*.gguf{,.inp,.out}`) and llama.cpp's ids for the corpus above.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
llama_cpp = pytest.importorskip("llama_cpp")

import pretok_fixtures as fx  # noqa: E402

from kvq.errors import ModelError  # noqa: E402
from kvq.text import load_tokenizer  # noqa: E402
from kvq.text.pretokenizers import PRE_TOKENIZERS, PreTokenizer  # noqa: E402

LLAMA_CPP_NAMES = sorted(set(PRE_TOKENIZERS) - {"gpt2"})  # gpt2: kvq's alias, llama.cpp refuses it


@cache
def _trained(pre: PreTokenizer) -> Any:
    return fx.train(pre)


def _pieces(llm: Any, ids: list[int]) -> list[bytes]:
    return [llm.detokenize([i], special=True) for i in ids]


@pytest.mark.parametrize("name", LLAMA_CPP_NAMES)
def test_encodes_like_llama_cpp(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.gguf"
    fx.write_vocab(path, name, _trained(PRE_TOKENIZERS[name]))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ours = load_tokenizer(path)
    differ = []
    for text in fx.CASES:
        theirs = llm.tokenize(text.encode(), add_bos=True, special=True)
        if ours.encode(text) != theirs:
            differ.append((text, _pieces(llm, ours.encode(text)), _pieces(llm, theirs)))
        body = theirs[1:] if theirs[:1] == [ours.bos_id] else theirs  # the wrapper eats a space
        assert ours.decode(body) == llm.detokenize(body).decode("utf-8", "replace"), text
    assert not differ, f"{len(differ)}/{len(fx.CASES)} cases differ, first: {differ[0]}"


# merges learned across whole lines: every piece boundary a pre-tokenizer draws changes ids
LINES = PreTokenizer((r"[^\n]+|\n+",))
# where a vocabulary trained on a name's own splits cannot tell two regexes apart (no merge
# crosses the boundary one draws and the other does not), one trained on LINES can
COARSE_NAMES = ("qwen35", "qwen2", "llama-bpe", "gpt-4o", "deepseek-v3", "kimi-k2")


@pytest.mark.parametrize("name", COARSE_NAMES)
def test_coarse_vocabulary_encodes_like_llama_cpp(tmp_path: Path, name: str) -> None:
    """The same check over a vocabulary whose merges span words, marks and spaces: it fails
    when kvq cuts a piece llama.cpp does not (qwen35 run with Qwen2's regex: the combining
    marks that Qwen3.5's words take)."""
    path = tmp_path / f"{name}.gguf"
    fx.write_vocab(path, name, _trained(LINES))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ours = load_tokenizer(path)
    differ = [
        text
        for text in fx.CASES
        if ours.encode(text) != llm.tokenize(text.encode(), add_bos=True, special=True)
    ]
    assert not differ, f"{len(differ)}/{len(fx.CASES)} cases differ, first: {differ[:3]!r}"


def test_bos_and_visible_tokens_follow_llama_cpp(tmp_path: Path) -> None:
    tok = {}
    for name in ("llama-bpe", "gpt-4o", "deepseek-v3"):
        fx.write_vocab(tmp_path / f"{name}.gguf", name, _trained(PRE_TOKENIZERS[name]))
        tok[name] = load_tokenizer(tmp_path / f"{name}.gguf")
    assert tok["llama-bpe"].encode("hi")[0] == tok["llama-bpe"].bos_id  # llama3: BOS by default
    assert tok["gpt-4o"].encode("hi")[0] != tok["gpt-4o"].bos_id  # gpt-4o: none
    harmony = "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    # harmony's structure tokens stay in decoded text (as in llama.cpp); <|return|> does not
    assert tok["gpt-4o"].decode(tok["gpt-4o"].encode(harmony)) == harmony[: -len("<|return|>")]
    assert tok["deepseek-v3"].decode(tok["deepseek-v3"].encode(f"{fx.BOS}hi{fx.EOS}")) == "hi"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "vocab" in metafunc.fixturenames:  # llama.cpp's real vocabularies, where there are some
        src = Path(metafunc.config.getoption("--llama-cpp-src"))
        vocabs = sorted((src / "models").glob("ggml-vocab-*.gguf"))
        metafunc.parametrize("vocab", vocabs or [None], ids=lambda p: p and p.name)


@pytest.mark.slow  # reading a real vocabulary's metadata takes seconds
@pytest.mark.timeout(600)
def test_llama_cpp_real_vocabularies(vocab: Path | None) -> None:
    if vocab is None:
        pytest.skip("no llama.cpp vocabularies: pass --llama-cpp-src=TREE (.ci/run unpacks them)")
    try:
        tok = load_tokenizer(vocab)
    except ModelError as exc:  # bert, gemma4...: vocabulary kinds kvq does not run
        pytest.skip(str(exc)[-80:])
    inp = vocab.with_suffix(".gguf.inp")
    if inp.exists():
        cases = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        cases = cases[:-1] if cases[-1] == "" else cases
        lines = vocab.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
        for text, line in zip(cases, lines, strict=False):
            assert tok.encode(text, add_bos=False) == [int(x) for x in line.split()], text
    llm = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
    for text in fx.CASES:  # and this corpus, BOS and special tokens included
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
