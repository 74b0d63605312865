"""`KVQ_LOG_FORMAT=json` (issue 30, item 8): one JSON object a line, passwords redacted, the
traceback in `exc`. The roles' "ready" lines are checked on real processes in
tests/monitor/test_dashboard.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from kvq import logs


def bare_root() -> None:
    """A root logger without handlers, as in a kvq process (configure leaves others' alone;
    pytest adds its own before each test's body)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_with_redaction_and_traceback(
    restore_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    bare_root()
    logs.configure(verbose=False, fmt="json")
    log = logging.getLogger("kvq.test")
    log.info("connecting to %s", "redis://user:s3cret@db:6379/0")
    log.debug("not shown at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(x) for x in lines)
    assert set(first) == {"ts", "level", "logger", "message"}
    assert first["level"] == "INFO" and first["logger"] == "kvq.test"
    assert "s3cret" not in lines[0] and "redis://user:" in first["message"]
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


def test_text_is_the_default(restore_root: None, capsys: pytest.CaptureFixture[str]) -> None:
    bare_root()
    logs.configure(verbose=True)
    logging.getLogger("kvq.test").debug("hello %d", 3)
    line = capsys.readouterr().err.strip()
    assert line.endswith("kvq.test DEBUG hello 3")
