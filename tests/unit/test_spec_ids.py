"""Every spec id the code and the docs cite (`K4`, `H3`, `B5`, ...) is defined in docs/spec.md.

Python files are read through `tokenize`, so only comments and strings count (an identifier
named `B1` is no citation); other text files (Markdown, Lua, C, YAML, ...) are read whole. A
range (`K1-K4`, `H1–H11`) cites every id in it.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
SCANNED = (ROOT / "kvq", ROOT / "docs")
TEXT = {".py", ".md", ".lua", ".c", ".h", ".js", ".html", ".css", ".yml", ".yaml", ".toml"}

ID = r"[DKHBX][0-9]{1,2}"
# Not after a word character, `#`, `$`, `.` or `-` (hex `0xB5`, CSS `#D1D5DB`, `Kimi-K2`), nor
# before one; a range's second id is taken with its first.
CITE = re.compile(rf"(?<![\w#$.\-])({ID})(?:\s*[-–]\s*({ID}))?(?![\w\-])")
# an id compared or computed with (`B1 < B2`: batch sizes) is a variable, not a citation
ALGEBRA = re.compile(r"^\s*[<>=+*]|[<>=+*]\s*$")
DEFINED = re.compile(rf"^- \*\*({ID})\*\* ", re.M)


def cited(text: str) -> set[str]:
    """The spec ids a piece of prose cites, ranges expanded."""
    out: set[str] = set()
    for m in CITE.finditer(text):
        before, after = text[max(0, m.start() - 3) : m.start()], text[m.end() : m.end() + 3]
        if ALGEBRA.search(before) or ALGEBRA.search(after):
            continue
        first, last = m.group(1), m.group(2)
        if last is None:
            out.add(first)
        elif first[0] == last[0] and int(first[1:]) < int(last[1:]):
            out.update(f"{first[0]}{n}" for n in range(int(first[1:]), int(last[1:]) + 1))
        else:  # `K2-H3`: two ids, not a range
            out.update((first, last))
    return out


def prose(path: Path) -> str:
    """What of a file can cite an id: a Python file's comments and strings, any other whole."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}  # 3.12+
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(t.string for t in tokens if t.type in kinds)


def citations() -> dict[str, list[str]]:
    """Each cited id and the files that cite it (relative paths)."""
    where: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted(top.rglob("*")):
            if path.suffix not in TEXT or "__pycache__" in path.parts or not path.is_file():
                continue
            for spec_id in cited(prose(path)):
                where.setdefault(spec_id, []).append(path.relative_to(ROOT).as_posix())
    return where


def defined() -> list[str]:
    return DEFINED.findall(SPEC.read_text(encoding="utf-8"))


def test_every_cited_id_is_defined() -> None:
    known = set(defined())
    missing = {i: files for i, files in citations().items() if i not in known}
    assert not missing, "\n".join(
        f"{i} (cited in {', '.join(files)}) is not defined in docs/spec.md"
        for i, files in sorted(missing.items())
    )


def test_the_scan_finds_the_citations_it_should() -> None:
    where = citations()
    assert len(where) >= 30, sorted(where)
    assert "kvq/swarm/live.py" in where["K4"]
    assert "docs/routing.md" in where["H3"]
    assert "kvq/lua/retire.lua" in where["K10"]


def test_each_family_is_defined_once_and_without_gaps() -> None:
    ids = defined()
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    for family in "DKHBX":
        numbers = sorted(int(i[1:]) for i in ids if i[0] == family)
        assert numbers == list(range(1, len(numbers) + 1)), (family, numbers)
        assert numbers, family


@pytest.mark.parametrize(
    "text,ids",
    [
        ("a K4 trial", {"K4"}),
        ("(K1-K4, H3)", {"K1", "K2", "K3", "K4", "H3"}),
        ("(H1–H11)", {f"H{n}" for n in range(1, 12)}),
        ("K6-K12 timed", {f"K{n}" for n in range(6, 13)}),
        ("H6/H7 and B5:", {"H6", "H7", "B5"}),
        ("Kimi-K2, DeepSeek-V3", set()),
        ("color: #D1D5DB; 0xB5, $X1, a.B2", set()),
        ("K4_MAX, XK4, K4x, Q4_K, H100, B12345", set()),
        ("sequences B1 < B2", set()),
    ],
)
def test_what_counts_as_a_citation(text: str, ids: set[str]) -> None:
    assert cited(text) == ids
