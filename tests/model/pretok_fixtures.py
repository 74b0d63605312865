"""A corpus that exercises pre-tokenizers, and byte-level vocabularies trained on it per
pre-tokenizer, written to GGUF as llama.cpp's converter writes a `gpt2` vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

from kvq.text.pretokenizers import PreTokenizer

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
# the families' special tokens, typed as their files type them (llama.cpp retypes some by text)
CONTROL = [
    BOS,
    EOS,
    "<|begin_of_text|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "[gMASK]",
    "<sop>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|observation|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
USER_DEFINED = [
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

_WHITESPACE = [
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\r\n",
    " \n",
    "\n ",
    " \t \n",
    "a  b",
    "a   b",
    "a\tb",
    "a \tb",
    "a\t b",
    "a\n\nb",
    "a \n b",
    "trailing   ",
    "   leading",
    "x" + " " * 20 + "y",
    "\u3000wide\u3000space",
    "nbsp\u00a0here",
    "a\u2003b\u2009c",
]
_DIGITS = [
    "1",
    "12",
    *(("1234567890123")[:n] for n in range(3, 13)),
    "x1y22z333",
    "3.14159",
    "2024-06-01",
    "1,000,000",
    "v2.0.1",
    "\u0663\u0664\u0665 arabic digits",
    "\u2460\u00bd",
]
_SCRIPTS = [
    "日本語のテキストです。",
    "中文分词测试，你好世界！",
    "한국어 텍스트입니다",
    "Привет, мир!",
    "Ελληνικά κείμενα",
    "עברית וערבית عربي",
    "हिन्दी पाठ",
    "ไทยภาษา",
    "ΑΒΓ and ßtraße",
    "mixed日本English中文123",
    "ÉCOLE école École aÉb",
    "mÜnchen ÉcoleÉCOLE ΣίσυφοςΣ ǅungla",
    "中\u2003文",
    "日本\u3000語",
    "。\u3000、",
    "1\u3000\u30002",
    "\u3000",
    "x\u2028y\u0085z",
]
_EMOJI = [
    "🦙",
    "🦙.cpp",
    "👍🏽",
    "👨\u200d👩\u200d👧\u200d👦 family",
    "🇯🇵 flag",
    "❤️ heart",
    "a🎉b",
]
_CODE = [
    "def f(x):\n    return x * 2\n",
    "if (a && b) { c++; }",
    "x = [i**2 for i in range(10)]",
    "    indented\n\tand tabbed",
    '<div class="a">b</div>',
    "SELECT * FROM t WHERE id=1;",
    "path/to/file.py:42",
    "__init__ self._x = None",
    "$HOME ~/.bashrc | grep -v '^#'",
]
# combining marks: inside words, and after what is not a letter (Qwen3.5's words take \p{M})
_MARKS = [
    "cafe\u0301",
    "e\u0301\u0301",
    "n\u0303o",
    "a\u0308b\u0308c",
    "\u0301alone",
    "9\u0308 x",
    "!\u0301?",
    " \u0301\u0302 ",
    "\u0301\u0301",
    "x'\u0301s",
    "Tie\u0302\u0301ng Vie\u0323\u0302t",
    "\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651",
    "\u0e17\u0e35\u0e48\u0e19\u0e35\u0e48",
    "\u0915\u093f\u0924\u093e\u092c\u0947\u0902 \u0967\u0968",
]
_APOSTROPHES = [
    "it's",
    "we'll",
    "THEY'RE",
    "I'M",
    "you've",
    "he'd",
    "don't",
    "'s",
    "'ll 'RE",
    "rock 'n' roll",
    "O'Neil's",
    "l'homme",
    "\u2019s curly",
]
_PUNCT = [
    "Hello, world!",
    "...",
    "!!!???",
    "a.b,c;d:e",
    "--==>>",
    "(((nested)))",
    "—dash–",
    "«quotes» „low“",
    "¿qué? ¡sí!",
    "#$%&*+<=>@^_`|~",
    "。，、！",
]
_SPECIAL = [
    f"{BOS}hello{EOS}",
    "<|header_start|>user<|header_end|>\n\nhi<|eot|>",
    "<|start|>assistant<|channel|>analysis<|message|>think<|end|>",
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
    "[gMASK]<sop><|user|>\nhello<|assistant|>",
    "<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c><think>\nhmm</think>ok",
    "<|im_start|>system\nbe brief<|im_end|>\n",
    "<|endoftext|><|endoftext|>",
    "a<|end|>b <|call|> c",
    '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>',
    "<|vision_start|><|image_pad|><|vision_end|>describe it",
]
CASES: list[str] = [
    "",
    *_WHITESPACE,
    *_DIGITS,
    *_SCRIPTS,
    *_EMOJI,
    *_CODE,
    *_MARKS,
    *_APOSTROPHES,
    *_PUNCT,
    *_SPECIAL,
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "Mixture-of-experts models route each token to a few experts out of many.",
]
TRAIN_TEXT = "\n".join(CASES * 3) + (
    "\nthe experts route tokens; the router scores experts and keeps the top k.\n" * 5
)


def _merges(tok: Any) -> list[str]:
    raw = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in raw]


def train(pre: PreTokenizer, vocab_size: int = 900) -> Any:
    """A byte-level BPE learned from TRAIN_TEXT cut by `pre`'s regexes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    return tok


def write_vocab(path: Path, name: str, tok: Any, add_bos: bool | None = None) -> list[str]:
    """A vocabulary-only GGUF: `tok`'s tokens and merges, a few whole pieces no merge reaches
    (so ignore_merges shows), then the special tokens; no add_bos key unless given, so the
    pre-tokenizer's default decides. Returns the token list."""
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    special = {t: TokenType.CONTROL for t in CONTROL} | dict.fromkeys(
        USER_DEFINED, TokenType.USER_DEFINED
    )
    known = set(tokens)
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(TRAIN_TEXT)]
    tokens += sorted({p for p in pieces if len(p) >= 3 and p not in known | set(special)})
    tokens += [t for t in special if t not in known]  # the trainer may have learned some
    types = [special.get(t, TokenType.NORMAL) for t in tokens]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(name)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_merges(tok))
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens
