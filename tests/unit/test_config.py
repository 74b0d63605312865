"""kvq.config: defaults, KVQ_* environment variables, errors naming the variable, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from kvq.config import Settings, child_env, describe, env_name, load_settings
from kvq.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVQ_* variable of the calling shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)


def test_defaults_are_valid() -> None:
    s = load_settings()
    for name, field in Settings.model_fields.items():
        assert getattr(s, name) == field.default, name
    assert s.redis_url == "redis://127.0.0.1:6379/0" and s.prefix == "kvq"


def test_every_field_has_a_description() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize(
    ("var", "value", "field", "want"),
    [
        ("KVQ_N_SLOTS", "8", "n_slots", 8),
        (
            "KVQ_REDIS_URL",
            "rediss://cache.example:6380/2",
            "redis_url",
            "rediss://cache.example:6380/2",
        ),
        ("KVQ_REDIS_URL", "unix:///tmp/redis.sock", "redis_url", "unix:///tmp/redis.sock"),
        ("KVQ_PREFIX", "prod-a", "prefix", "prod-a"),
        ("KVQ_VERIFY_REMOTE", "1", "verify_remote", "all"),  # the old boolean form
        ("KVQ_VERIFY_REMOTE", "false", "verify_remote", "off"),
        ("KVQ_VERIFY_REMOTE", "sampled", "verify_remote", "sampled"),
        ("KVQ_TRUST_P_MIN", "0.05", "trust_p_min", 0.05),
        ("KVQ_HEARTBEAT_TTL_S", "2.5", "heartbeat_ttl_s", 2.5),
        ("KVQ_DEVICE", "cuda:1", "device", "cuda:1"),
        ("KVQ_DEVICE", "cpu", "device", "cpu"),
    ],
)
def test_env_vars_are_read(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str, want: object
) -> None:
    monkeypatch.setenv(var, value)
    assert getattr(load_settings(), field) == want


def test_overrides_beat_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_N_SLOTS", "8")
    assert load_settings(n_slots=16).n_slots == 16


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(pydantic.ValidationError):
        s.n_slots = 9  # type: ignore[misc]


def test_env_name() -> None:
    assert env_name("n_slots") == "KVQ_N_SLOTS"
    for row in describe(load_settings()):
        assert row["env"] == "KVQ_" + row["name"].upper()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVQ_REDIS_URL", "notaurl"),
        ("KVQ_REDIS_URL", "http://127.0.0.1:6379"),
        ("KVQ_REDIS_URL", "redis://"),
        ("KVQ_JOB_DEADLINE_MS", "-1"),
        ("KVQ_JOB_DEADLINE_MS", "0"),
        ("KVQ_SOCKET_TIMEOUT_S", "-0.5"),
        ("KVQ_HEARTBEAT_TTL_S", "0"),
        ("KVQ_BLOCK_MS", "60001"),
        ("KVQ_STREAM_MAXLEN", "99"),
        ("KVQ_N_SLOTS", "0"),
        ("KVQ_N_SLOTS", "many"),
        ("KVQ_DEVICE", "tpu"),
        ("KVQ_DEVICE", "gpu"),
        ("KVQ_PREFIX", "a:b"),
        ("KVQ_PREFIX", "{x}"),
        ("KVQ_PREFIX", "has space"),
        ("KVQ_VERIFY_REMOTE", "perhaps"),
        ("KVQ_TRUST_DECAY", "1.5"),
        ("KVQ_TRUST_P_MIN", "nan"),
    ],
)
def test_invalid_value_names_the_env_var(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    msg = str(info.value)
    assert var in msg
    assert repr(value) in msg  # the bad value is shown


def test_several_errors_are_all_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_REDIS_URL", "notaurl")
    monkeypatch.setenv("KVQ_DEVICE", "tpu")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "KVQ_REDIS_URL" in str(info.value) and "KVQ_DEVICE" in str(info.value)


def test_saturation_threshold_above_n_slots_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_N_SLOTS", "4")
    monkeypatch.setenv("KVQ_SATURATION_THRESHOLD", "5")
    with pytest.raises(ConfigError, match="(?i)saturation_threshold"):
        load_settings()


def test_saturation_threshold_error_names_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_N_SLOTS", "4")
    monkeypatch.setenv("KVQ_SATURATION_THRESHOLD", "5")
    with pytest.raises(ConfigError, match="KVQ_SATURATION_THRESHOLD"):
        load_settings()


def test_saturation_threshold_equal_to_n_slots_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_N_SLOTS", "3")
    monkeypatch.setenv("KVQ_SATURATION_THRESHOLD", "3")
    assert load_settings().saturation_threshold == 3


@pytest.mark.parametrize("value", ["0", "9", "5"])
def test_microbatches_out_of_range_is_rejected(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVQ_N_SLOTS", "4")  # 5: within 1-8 but more than the slots
    monkeypatch.setenv("KVQ_MICROBATCHES", value)
    with pytest.raises(ConfigError, match="KVQ_MICROBATCHES"):
        load_settings()


def test_microbatches_reach_the_dispatch_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_MICROBATCHES", "2")
    assert load_settings().dispatch.microbatches == 2


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match="KVQ_NO_SUCH_SETTING"):
        load_settings(no_such_setting=1)


def test_child_env_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(n_slots=7, verify_remote=True, heartbeat_ttl_s=1.25, prefix="pfx")
    env = child_env(s, device="cpu")
    assert env["KVQ_VERIFY_REMOTE"] == "all" and env["KVQ_DEVICE"] == "cpu"
    for name, value in env.items():
        if name.startswith("KVQ_"):
            monkeypatch.setenv(name, value)
    assert load_settings() == s.model_copy(update={"device": "cpu"})


def test_describe_lists_every_field() -> None:
    s = load_settings(n_slots=9)
    rows = {row["name"]: row for row in describe(s)}
    assert set(rows) == set(Settings.model_fields)
    assert rows["n_slots"]["value"] == 9 and rows["n_slots"]["default"] == 4


# -- CLI -----------------------------------------------------------------------------------
def run_cli(tmp_path: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")} | env_vars
    return subprocess.run(
        [sys.executable, "-m", "kvq", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_config_check_bad_env(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "config", "check", KVQ_REDIS_URL="notaurl")
    assert proc.returncode == 2, proc.stderr
    assert "KVQ_REDIS_URL" in proc.stderr
    assert "notaurl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_config_check_good_env(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "config", "check", KVQ_N_SLOTS="8", KVQ_DEVICE="cpu")
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


def test_cli_config_show_json(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "config", "show", "--json", KVQ_N_SLOTS="8", KVQ_PREFIX="demo")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert set(shown) == set(Settings.model_fields)
    assert shown["n_slots"] == 8 and shown["prefix"] == "demo"
    want = load_settings(n_slots=8, prefix="demo").model_dump()
    assert shown == want


def test_unknown_kvq_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_N_SLOT", "8")  # typo of KVQ_N_SLOTS
    with pytest.raises(ConfigError, match="KVQ_N_SLOT"):
        load_settings()


@pytest.mark.parametrize(
    "query", ["ssl_cert_reqs=none", "ssl_cert_reqs=optional", "ssl_check_hostname=false"]
)
def test_url_options_that_weaken_tls_need_tls_insecure(
    monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """A URL copied with `?ssl_cert_reqs=none` must not turn certificate checks off silently:
    refused, naming both settings, until KVQ_TLS_INSECURE=1 says it is meant (which warns at
    connect: tests/bus/test_tls.py)."""
    monkeypatch.setenv("KVQ_REDIS_URL", f"rediss://h:6380/0?{query}")
    with pytest.raises(ConfigError) as info:
        load_settings()
    msg = str(info.value)
    assert "KVQ_REDIS_URL" in msg and "KVQ_TLS_INSECURE" in msg and query in msg
    monkeypatch.setenv("KVQ_TLS_INSECURE", "1")
    assert load_settings().tls_insecure
    monkeypatch.setenv("KVQ_REDIS_URL", "rediss://h:6380/0?ssl_cert_reqs=required")
    monkeypatch.delenv("KVQ_TLS_INSECURE")
    assert load_settings().redis_url.endswith("required")
