"""Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` name, as llama.cpp runs them.

A pre-tokenizer cuts text into pieces before BPE merges run inside each piece. llama.cpp
(`src/llama-vocab.cpp`, llama-cpp-python 0.3.36) maps each name to a list of regexes applied in
order: each regex splits every piece left by the one before, and both the matches and the text
between them become pieces. `tokenizers`' `Sequence` of `Split(..., "isolated")` does the same.

The regexes are llama.cpp's strings with three kinds of change, each to make Oniguruma (what
`tokenizers` runs) cut where llama.cpp cuts:

- where llama.cpp runs a hand-written splitter (GPT-2, Llama-3, Qwen2, Qwen3.5, Kimi-K2), the
  regex that splitter implements: the original from the model's tokenizer.json (Kimi-K2's
  without the case and mark classes the splitter ignores);
- `std::regex` sees every non-ASCII whitespace character as U+000B, so a literal character
  class never matches one: classes whose ranges span such characters exclude `\\s`;
- the rest verbatim, e.g. GPT-4o's `((?=[\\p{L}])([^a-z]))*` (llama.cpp's stand-in for
  `\\p{Lu}`: any non-ASCII letter counts as both cases, where tiktoken tells them apart).
"""

from __future__ import annotations

from dataclasses import dataclass

# the contraction alternatives llama.cpp writes without (?i:) (std::regex lacks it)
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-"
    "\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15"
    "\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183"
    "\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# U+0800..U+4E00 spans non-ASCII whitespace (U+1680, U+2000.., U+3000): llama.cpp never matches it
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
DEEPSEEK_LLM = (
    r"[\r\n]",
    rf"\s?[{_DEEPSEEK_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",  # U+3000: see above
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK3_WORDS = (
    r"[!"
    '"'
    r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
)
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
SPARK2_5 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)
# llama.cpp's std::regex sees \\p{Lu}, \\p{Ll}... all as "a letter", so case is not told apart here
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+<C>|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*<C>"
).replace("<C>", f"{_CONTRACTIONS}?")
YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
    "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_NO_TAIL, r"[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", _GPT2_NO_TAIL)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_NO_TAIL, r"\p{N}+", r"[0-9][0-9][0-9]")
JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_LOOKAHEAD_CASED = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+<C>"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*<C>"
)
TEKKEN = _LOOKAHEAD_CASED.replace("<C>", "") + (
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = _LOOKAHEAD_CASED.replace("<C>", f"{_CONTRACTIONS}?") + (
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAMELEON = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    _GPT2_NO_TAIL,
)
# Kimi-K2: tokenization_kimi.py's regex as llama.cpp's hand-written splitter runs it, which
# takes neither case nor combining marks into account (a mark is not part of a word)
_NOT_HAN = r"[\p{L}&&[^\p{Han}]]"
KIMI_K2 = (
    rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
MINICPM5 = (
    r"\p{N}{1,3}",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` cuts text, and the defaults llama.cpp gives it."""

    splits: tuple[str, ...]  # regexes applied in order, matches isolated
    ignore_merges: bool = False  # a piece that is a whole token stays one token
    add_bos: bool = False  # when the file has no tokenizer.ggml.add_bos_token


def _all(names: str, splits: str | tuple[str, ...], **kw: bool) -> dict[str, PreTokenizer]:
    pre = PreTokenizer((splits,) if isinstance(splits, str) else splits, **kw)
    return dict.fromkeys(names.split(), pre)


# every name llama.cpp accepts for a byte-level vocabulary whose splitting kvq reproduces
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_all("default", DEFAULT),
    **_all("gpt2", GPT2),  # kvq's older files (llama.cpp spells it gpt-2)
    **_all(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "mpt olmo jais trillion granite-docling exaone4",
        GPT2,
    ),
    **_all(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        LLAMA3,
        ignore_merges=True,
        add_bos=True,
    ),
    **_all("dbrx smaug-bpe chatglm-bpe", LLAMA3),
    **_all("glm4 glm5", LLAMA3, ignore_merges=True),
    **_all("minicpm5", MINICPM5, ignore_merges=True),
    **_all("deepseek-llm", DEEPSEEK_LLM),
    **_all("deepseek-coder", DEEPSEEK_CODER),
    **_all("deepseek-v3 hunyuan-dense joyai-llm hy_v4", DEEPSEEK3),
    **_all("spark2_5", SPARK2_5),
    **_all("youtu", YOUTU, ignore_merges=True),
    **_all("falcon", FALCON),
    **_all("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", STARCODER),
    **_all(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", QWEN2
    ),
    **_all("qwen35", QWEN35),
    **_all("jais-2", JAIS2),
    **_all("poro-chat bloom gpt3-finnish", PORO),
    **_all("viking", (PORO, r"\p{N}")),
    **_all("tekken", TEKKEN, ignore_merges=True, add_bos=True),
    **_all("chameleon", CHAMELEON, add_bos=True),
    **_all("gpt-4o llama4 kanana2 talkie minimax-m2", GPT4O),
    **_all("kimi-k2", KIMI_K2),
    **_all("bailingmoe bailingmoe2 llada-moe", BAILINGMOE),
    **_all("seed-coder", SEED_CODER),
    **_all("ufakzeka", UFAKZEKA),
    **_all("laguna", (r"[^\n]+|[\n]+", QWEN2)),
    **_all("exaone-moe", EXAONE_MOE),
}
