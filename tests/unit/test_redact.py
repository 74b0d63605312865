"""Passwords never printed: `kvq config show`, invalid-setting messages, log records."""

from __future__ import annotations

import logging

import pytest

from kvq.cli import main
from kvq.config import load_settings
from kvq.errors import ConfigError
from kvq.security.redact import RedactingFilter, redacted_text, redacted_url

SECRET = "s3cr%40t-pw"


def test_urls_lose_their_password_only() -> None:
    assert (
        redacted_url(f"rediss://kvq-worker-a:{SECRET}@h:6380/0")
        == "rediss://kvq-worker-a:***@h:6380/0"
    )
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_text(f"Error connecting to redis://u:{SECRET}@h:1/0.") == (
        "Error connecting to redis://u:***@h:1/0."
    )


def test_config_show_redacts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVQ_REDIS_URL", f"redis://kvq-monitor:{SECRET}@h:6379/0")
    monkeypatch.setenv("KVQ_API_KEYS", "key-abcdefgh-123")
    for argv in (["config", "show"], ["config", "show", "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "key-abcdefgh-123" not in out and "kvq-monitor:***@h" in out


def test_an_invalid_url_is_reported_without_its_password() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url=f"http://u:{SECRET}@h/0")
    assert SECRET not in str(err.value) and "KVQ_REDIS_URL" in str(err.value)


def test_log_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvq.test-redact")
    caplog.handler.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger="kvq.test-redact"):
        log.info("connecting to %s", f"redis://u:{SECRET}@h:1/0")
    assert SECRET not in caplog.text and "redis://u:***@h:1/0" in caplog.text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://h:6379/0?password={SECRET}", "redis://h:6379/0?password=***"),
        (f"redis://h:6379/0?db=1&password={SECRET}&x=2", "redis://h:6379/0?db=1&password=***&x=2"),
        (
            f"rediss://u:{SECRET}@h:1/0?ssl_password={SECRET}",
            "rediss://u:***@h:1/0?ssl_password=***",
        ),
        (f"redis+cluster://u:{SECRET}@h:1", "redis+cluster://u:***@h:1"),
        (f"unix:///run/r.sock?password={SECRET}", "unix:///run/r.sock?password=***"),
        (f"redis://:{SECRET}@h:1/0", "redis://:***@h:1/0"),
    ],
)
def test_every_url_form_loses_its_password(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
    assert SECRET not in redacted_text(f"Error connecting to {url}.")


def test_config_show_redacts_a_query_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVQ_REDIS_URL", f"redis://h:6379/0?password={SECRET}")
    for argv in (["config", "show"], ["config", "show", "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "password=***" in out
