"""Every command's exit codes as docs/cli.md states them (issue 30, item 5): one table, run
in-process against a real Redis; every flag has help; a bad argument is one line on stderr and
exit 2, never a traceback. Generated rows: `--help` (0) and an unknown flag (2) for every
command, a malformed value (2) for every typed flag."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.cli import build_parser, main
from kvq.config import Settings
from kvq.tools.synth import make_tiny

DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def commands(
    p: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command path (`("bench", "bus")`, ...) with its parser, leaves only."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, p
    for a in subs:
        for name, sp in a.choices.items():
            yield from commands(sp, (*path, name))


def required(p: argparse.ArgumentParser) -> list[str]:
    """Plausible values for a command's required arguments, so that one bad flag is the
    only thing wrong."""
    out: list[str] = []
    for a in p._actions:
        if a.option_strings and a.required:
            out += [a.option_strings[0], "x"]
        elif not a.option_strings and a.nargs not in ("*", "?") and a.dest != "help":
            out.append(a.choices[0] if a.choices else "x")  # type: ignore[index]
    return out


def generated() -> list[tuple[list[str], int]]:
    rows: list[tuple[list[str], int]] = [
        ([], 2),
        (["--version"], 0),
        (["--help"], 0),
        (["no-such-command"], 2),
    ]
    for path, p in commands(build_parser()):
        rows.append(([*path, "--help"], 0))
        rows.append(([*path, *required(p), "--no-such-flag"], 2))
        for a in p._actions:
            if a.option_strings and a.type not in (None, str) and a.nargs is None:
                rows.append(([*path, *required(p), a.option_strings[0], "x!"], 2))
    return rows


GENERATED = generated()


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Settings:
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("KVQ_PREFIX", settings.prefix)
    monkeypatch.setenv("KVQ_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return settings


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(("argv", "code"), GENERATED, ids=[" ".join(a) for a, _ in GENERATED])
def test_generated_usage_rows(
    argv: list[str], code: int, env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    got, err = run(argv, capsys)
    assert got == code, (argv, err)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err


# (argv, extra env, exit code, a word stderr/stdout must hold): what each command does at run time
RUNTIME: list[tuple[list[str], dict[str, str], int, str]] = [
    (["config", "check"], {}, 0, ""),
    (["config", "show", "--json"], {}, 0, ""),
    (["config", "check"], {"KVQ_N_SLOTS": "-1"}, 2, "KVQ_N_SLOTS"),
    (["config", "check"], {"KVQ_NO_SUCH_SETTING": "1"}, 2, "NO_SUCH_SETTING"),
    (["health", "redis"], {}, 0, ""),
    (["health", "redis"], {"KVQ_REDIS_URL": DOWN}, 1, ""),
    (["health", "coordinator", "--id", "nobody"], {}, 1, ""),
    (["health", "worker", "--id", "nobody"], {}, 1, ""),
    (["health", "monitor"], {}, 1, ""),
    (["health", "api", "--id", "http://127.0.0.1:1"], {}, 1, "kvq api at"),
    (["acl"], {}, 0, ""),
    (["acl", "--role", "worker"], {}, 2, "--worker"),
    (["acl", "--role", "nope"], {}, 2, "nope"),
    (["deadletter", "list"], {}, 0, ""),
    (["deadletter", "show", "1-1"], {}, 1, "1-1"),
    (["deadletter", "requeue"], {}, 2, "--all"),
    (["cancel", "m", "r-1"], {}, 0, "cancelled request r-1"),
    (["workers", "drain", "w-1"], {}, 0, "drain: worker w-1 in no model"),
    (["workers", "release", "no spaces"], {}, 2, "worker id"),
    (["workers", "quarantine", "w-1", "--for-s", "0"], {}, 2, "--for-s"),
    (["submit", "--model", "nope", "--prompt", "x"], {}, 1, "no coordinator"),
    (["submit", "--model", "m", "--prompt", "x", "--temperature", "9"], {}, 2, "temperature"),
    (["submit", "--model", "m", "--prompt", "x", "--top-p", "0"], {}, 2, "top-p"),
    (["submit", "--model", "m", "--prompt", "x", "--max-tokens", "0"], {}, 2, "max-tokens"),
    (
        [
            "submit",
            "--model",
            "m",
            "--prompt",
            "x",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop",
            "c",
            "--stop",
            "d",
            "--stop",
            "e",
        ],
        {},
        2,
        "stop",
    ),
    (["monitor", "--model", "tiny"], {}, 2, "ID=PATH"),
    (["monitor", "--model", "tiny=/no/such.gguf"], {}, 2, "/no/such.gguf"),
    (["demo", "--redis", "notaurl"], {}, 2, "Redis URL"),
    (["bench", "bus", "--redis", "http://x"], {}, 2, "Redis URL"),
    (["api", "--port", "70000"], {}, 2, "--port"),
    (["server", "--port", "-1"], {}, 2, "--port"),
    (["model", "make-tiny", "t.gguf", "--experts", "4", "--experts-used", "8"], {}, 1, "Model"),
    (["model", "make-tiny", "t.gguf"], {}, 0, ""),
    (["model", "inspect", "/no/such.gguf"], {}, 1, "ModelError"),
    (["generate", "--model", "/no/such.gguf", "--prompt", "x"], {}, 1, "ModelError"),
    (["generate", "--model", "m.gguf", "--prompt-ids", "1,x"], {}, 2, "prompt-ids"),
    (["swarm-sim", "--topology", "/no/such.yaml"], {}, 2, "/no/such.yaml"),
    (
        ["coordinator", "--model", "m.gguf", "--model-id", "nope"],
        {"KVQ_MODEL_WAIT_S": "0.3"},
        1,
        "nope",
    ),
    (["worker", "--id", "no spaces"], {}, 2, "worker id"),
    (["generate", "--model", "m.gguf", "--prompt", "x", "--temperature", "-1"], {}, 1, "Model"),
    (["bench", "swarm", "--nodes", "0"], {}, 2, "--nodes"),
    (
        ["balance", "plan", "--hist", "/no/such.json", "--budget-gib", "1"],
        {},
        1,
        "BankError",
    ),
]
IDS = [" ".join(a) + (f" [{next(iter(e))}]" if e else "") for a, e, _, _ in RUNTIME]


@pytest.mark.parametrize(("argv", "extra", "code", "word"), RUNTIME, ids=IDS)
def test_runtime_rows(
    argv: list[str],
    extra: dict[str, str],
    code: int,
    word: str,
    env: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    if "m.gguf" in argv:
        make_tiny(tmp_path / "m.gguf", layers=2, experts=8)
    try:
        got = main(argv)
    except SystemExit as exc:
        got = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    assert got == code, (argv, out.err)
    assert "Traceback" not in out.err
    assert word in out.err + out.out, out
    if code == 2 and not extra:  # a bad argument: one line (bad settings: one per problem)
        assert len(out.err.strip().splitlines()) == 1, out.err


def test_every_flag_has_help() -> None:
    missing = [
        f"{' '.join(path)} {a.option_strings or a.dest}"
        for path, p in commands(build_parser())
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._VersionAction) and not a.help
    ]
    assert not missing, missing


def test_the_table_covers_every_command() -> None:
    every = {" ".join(path) for path, _ in commands(build_parser())}
    run_at_all = {" ".join(a[:2]) for a, _, _, _ in RUNTIME} | {a[0] for a, _, _, _ in RUNTIME}
    assert every <= {" ".join(a[:-1]) for a, _ in GENERATED if a and a[-1] == "--help"}
    assert len(GENERATED) + len(RUNTIME) >= 150
    assert {"health", "submit", "config", "acl", "deadletter", "monitor", "api"} <= run_at_all
