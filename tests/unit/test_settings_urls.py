"""Redis URLs in the settings: both are printed without their password, and a port out of
range is a one-line usage error (exit 2), not a traceback."""

from __future__ import annotations

import pytest

from kvq.cli import main

SECRET = "rq-s3cret-pw"


def test_config_show_masks_the_rq_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVQ_RQ_URL", f"redis://rq-user:{SECRET}@h:6379/1")
    for argv in (["config", "show"], ["config", "show", "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "rq-user:***@h" in out


@pytest.mark.parametrize("env", ["KVQ_REDIS_URL", "KVQ_RQ_URL"])
@pytest.mark.parametrize("port", ["99999", "65536", "x1"])
def test_a_port_out_of_range_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: str, port: str
) -> None:
    monkeypatch.setenv(env, f"redis://u:{SECRET}@127.0.0.1:{port}/0")
    assert main(["health", "redis"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and SECRET not in err
    assert env in err and "[0, 65535]" in err and len(err.strip().splitlines()) <= 2, err
