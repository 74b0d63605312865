"""Claims of the operator docs checked against the code (issue 30, item 7): one check per kind of
false claim found, so the next one fails CI: every `KVQ_*` name is a setting (or said not to be
one), every default worker id has the form `kvq.security.identity` makes, every exit code is one the CLI
has. The pages: docs/*.md, README.md, workers/ (README, scripts, unit), compose.yaml."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from kvq.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from kvq.config import Settings, env_name
from kvq.security.identity import default_worker_id

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        ROOT / "compose.yaml",
        *(p for p in (ROOT / "workers").iterdir() if p.is_file()),
    ]
)
SETTINGS = {env_name(n) for n in Settings.model_fields}
INTERRUPTED = 130  # SIGINT, the cli's KeyboardInterrupt
CODES = {EXIT_OK, EXIT_FAIL, EXIT_USAGE, INTERRUPTED}
NOT_A_SETTING = re.compile(r"unknown|not a setting|no setting|not `KVQ|refuses|not KVQ", re.I)


def lines() -> list[tuple[str, int, str]]:
    return [
        (p.relative_to(ROOT).as_posix(), i, text)
        for p in PAGES
        for i, text in enumerate(p.read_text().splitlines(), 1)
    ]


def with_next(page: str, i: int) -> str:
    """A line and the one after it (a shell example, then what it prints)."""
    text = (ROOT / page).read_text().splitlines()
    return "\n".join(text[i - 1 : i + 1])


def with_previous(page: str, i: int) -> str:
    """A line and the one before it (a sentence wrapped over two)."""
    text = (ROOT / page).read_text().splitlines()
    return "\n".join(text[max(0, i - 2) : i])


def test_every_kvq_name_is_a_setting() -> None:
    wrong = []
    for page, i, text in lines():
        for m in re.finditer(r"KVQ_[A-Z0-9_]*[A-Z0-9]_?(\*)?", text):
            name = m.group(0).rstrip("*")
            if m.group(1) or name.endswith("_"):  # a family: KVQ_API_*
                if not any(s.startswith(name) for s in SETTINGS):
                    wrong.append(f"{page}:{i}: no setting starts with {name}")
            elif name not in SETTINGS and not NOT_A_SETTING.search(with_next(page, i)):
                wrong.append(f"{page}:{i}: {name} is no setting (docs/settings.md lists them)")
            elif name in SETTINGS and re.search(
                r"names that are not settings|is no setting|"
                r"not a setting",
                with_previous(page, i),
            ):
                wrong.append(f"{page}:{i}: {name} is a setting, said not to be one")
    assert not wrong, "\n".join(wrong)


def test_every_default_worker_id_is_the_one_kvq_makes(tmp_path: Path) -> None:
    made = default_worker_id(str(tmp_path), hostname="box")
    assert re.fullmatch(r"box-[0-9a-f]{6}", made), made
    wrong = []
    for page, i, text in lines():
        if re.search(r"worker-<host|worker-HOSTNAME|worker-\$\(hostname", text, re.I):
            wrong.append(f"{page}:{i}: a default worker id is <hostname>-<6 hex digits>")
        for m in re.finditer(r"<hostname>-<([^>]*)>", text, re.I):
            if not re.search(r"6 (random )?hex digits|suffix", m.group(1)):
                wrong.append(f"{page}:{i}: {m.group(0)}: the suffix is 6 hex digits")
    assert not wrong, "\n".join(wrong)


EXIT_CLAIM = re.compile(
    r"(?:exits?|exit code|exit status|exiting)(?: with)?(?: code| status)? (\d+)"
    r"|\(code (\d+)\)|\(exit (\d+)\)",
    re.I,
)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.suffix in (".md", ".sh", ".service")], ids=lambda p: p.name
)
def test_every_exit_code_is_one_the_cli_has(page: Path) -> None:
    wrong = []
    for i, text in enumerate(page.read_text().splitlines(), 1):
        for m in EXIT_CLAIM.finditer(text):
            code = int(next(g for g in m.groups() if g))
            if code not in CODES:
                wrong.append(f"{page.name}:{i}: exit {code}, but kvq exits {sorted(CODES)}")
    assert not wrong, "\n".join(wrong)


def test_the_cli_page_tables_exactly_those_codes() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    table = doc.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert codes == CODES, codes


# A dotted name or a path of the package in backquotes: `kvq.model.experts.sliced_forward`,
# `kvq/quant/csrc/qdot.c`. Each must still be there after a module moves or a name changes.
CODE_NAME = re.compile(r"`(kvq(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`|`(kvq/[A-Za-z0-9_/.]+\.[a-z]+)`")
# dotted names that are GGUF metadata keys kvq writes (`kvq model split`), not code
GGUF_KEYS = re.compile(r"kvq\.source\.")


def resolves(dotted: str) -> bool:
    """`dotted` is a module of kvq, or a name (an attribute, a method) reached from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_module_and_name_the_docs_give_exists() -> None:
    wrong = []
    for page, i, text in lines():
        for m in CODE_NAME.finditer(text):
            dotted, path = m.groups()
            if dotted and not GGUF_KEYS.match(dotted) and not resolves(dotted):
                wrong.append(f"{page}:{i}: {dotted} is not a module or name of kvq")
            if path and not (ROOT / path).exists():
                wrong.append(f"{page}:{i}: {path} does not exist")
    assert not wrong, "\n".join(wrong)


def stated_defaults() -> list[tuple[str, int, str, str]]:
    """Every `KVQ_X` (default V) / `KVQ_X`, default V / `KVQ_X` defaults to V in the docs, where
    V is a number (with or without a unit) or a backquoted literal."""
    pat = re.compile(
        r"`(KVQ_[A-Z0-9_]+)`(?: \(|, | )(?:the )?default(?:s to|:)? "
        r"(`[^`]+`|-?\d+(?:\.\d+)?)(?![\d.])( s\b)?"
    )
    return [
        (page, i, m.group(1), seconds_as_ms(m.group(1), m.group(2).strip("`"), m.group(3)))
        for page, i, text in lines()
        for m in pat.finditer(text)
    ]


def seconds_as_ms(name: str, value: str, unit: str | None) -> str:
    """ "`KVQ_X_MS` (default 5 s)" states 5000 ms."""
    return str(float(value) * 1000) if unit and name.endswith("_MS") else value


def same_value(stated: str, default: object) -> bool:
    if isinstance(default, bool):
        return stated.lower() in ({"true", "1"} if default else {"false", "0"})
    if default == "":
        return stated in ("", '""')
    if isinstance(default, (int, float)):
        try:
            return float(stated) == float(default)
        except ValueError:
            return False
    shown = ",".join(default) if isinstance(default, (list, tuple)) else str(default)
    return stated == shown


def test_every_stated_default_is_the_settings_default() -> None:
    found = stated_defaults()
    assert len(found) >= 5, found  # the pattern still finds the docs' claims
    fields = {env_name(n): f.default for n, f in Settings.model_fields.items()}
    wrong = [
        f"{page}:{i}: {name} defaults to {fields[name]!r}, not {value}"
        for page, i, name, value in found
        if name in fields and not same_value(value, fields[name])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_settings_table_gives_each_default() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    fields = {env_name(n): f.default for n, f in Settings.model_fields.items()}
    wrong = []
    for name, value in re.findall(r"^\| `(KVQ_[A-Z0-9_]+)` \| `([^`]*)` \|", doc, re.M):
        if fields[name] is not None and not same_value(value, fields[name]):
            wrong.append(f"settings.md: {name} defaults to {fields[name]!r}, not {value}")
    assert not wrong, "\n".join(wrong)


def test_no_issue_numbers_in_the_product_or_its_docs() -> None:
    """A reader cannot follow "issue 10 item 4": name the spec id or the behaviour."""
    sources = [*(ROOT / "kvq").rglob("*.py"), *(p for p in PAGES if p.suffix == ".md")]
    wrong = [
        f"{p.relative_to(ROOT)}:{i}: {m.group(0)}"
        for p in sources
        for i, text in enumerate(p.read_text().splitlines(), 1)
        for m in re.finditer(r"(?<!llama\.cpp )\b[Ii]ssues? #?\d+", text)
    ]
    assert not wrong, "\n".join(wrong)
