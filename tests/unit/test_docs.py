"""What the docs say about settings and `kvq config` is what the code does (issue 12 item 14):
the examples of docs/settings.md and docs/limits.md are run, and the counts checked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvq.cli import main
from kvq.config import Settings, env_name

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)


def test_the_settings_page_lists_every_setting_and_counts_them() -> None:
    doc = (DOCS / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(KVQ_[A-Z0-9_]+)`", doc, re.M))
    assert rows == {env_name(n) for n in Settings.model_fields}
    (count,) = re.findall(r"hold all (\d+) settings", doc)
    assert int(count) == len(Settings.model_fields)


def examples(page: str) -> list[tuple[str, str, str, int]]:
    """`$ KVQ_X=v kvq config check` examples followed by their output and `$ echo $?`."""
    doc = (DOCS / page).read_text()
    pat = r"\$ (KVQ_[A-Z_]+)=(\S+) kvq config check\n(.*?)\$ echo \$\?\n(\d+)"
    return [(k, v, out, int(rc)) for k, v, out, rc in re.findall(pat, doc, re.S)]


@pytest.mark.parametrize("var,value,out,rc", examples("settings.md"))
def test_documented_config_check_examples_hold(
    var: str,
    value: str,
    out: str,
    rc: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(var, value)
    assert main(["config", "check"]) == rc
    assert out.strip().splitlines()[0] in capsys.readouterr().err


def test_there_is_an_unknown_setting_example() -> None:
    assert any("unknown setting" in out for _, _, out, _ in examples("settings.md"))


def test_non_finite_numbers_are_refused_as_documented(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "KVQ_HEARTBEAT_TTL_S=inf kvq config check` exits 2" in (DOCS / "limits.md").read_text()
    monkeypatch.setenv("KVQ_HEARTBEAT_TTL_S", "inf")
    assert main(["config", "check"]) == 2
    assert "KVQ_HEARTBEAT_TTL_S" in capsys.readouterr().err


def test_config_check_json_prints_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "valid": True,
        "settings": len(Settings.model_fields),
    }
    monkeypatch.setenv("KVQ_N_SLOTS", "0")
    assert main(["config", "check", "--json"]) == 2
    got = json.loads(capsys.readouterr().out)
    assert got["valid"] is False and "KVQ_N_SLOTS" in got["error"]
