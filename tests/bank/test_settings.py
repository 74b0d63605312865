"""The bank's knobs (B6, B7): env names, defaults, empty KVQ_HOT_GIB, garbage refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.bank import GIB, BankOptions
from kvq.config import child_env, load_settings
from kvq.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = load_settings()
    assert (s.hot_gib, s.dynamic, s.dyn_steps, s.dyn_max_swaps) == (None, True, 2000, 2)
    assert (s.dyn_margin, s.vram_reserve_gib, s.numa_policy) == (1.25, 2.0, "preferred")
    o = BankOptions.from_settings(s)
    assert o.hot_bytes is None and o.vram_reserve_bytes == 2 * GIB and o.dynamic


@pytest.mark.parametrize("value", ["", "  ", "None"])
def test_empty_hot_gib_means_stock(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVQ_HOT_GIB", value)
    assert load_settings().hot_gib is None


def test_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {
        "KVQ_HOT_GIB": "1.5",
        "KVQ_DYNAMIC": "0",
        "KVQ_DYN_STEPS": "50",
        "KVQ_DYN_MAX_SWAPS": "4",
        "KVQ_DYN_MARGIN": "2",
        "KVQ_VRAM_RESERVE_GIB": "0.5",
        "KVQ_NUMA_POLICY": "bind",
    }.items():
        monkeypatch.setenv(k, v)
    o = BankOptions.from_settings(load_settings())
    assert o == BankOptions(
        hot_bytes=int(1.5 * GIB),
        dynamic=False,
        dyn_steps=50,
        dyn_max_swaps=4,
        dyn_margin=2.0,
        vram_reserve_bytes=GIB // 2,
        numa_policy="bind",
    )


def test_empty_strings_do_not_leak_into_other_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_DYN_STEPS", "")
    with pytest.raises(ConfigError, match="KVQ_DYN_STEPS"):
        load_settings()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVQ_DYN_STEPS", "0"),
        ("KVQ_DYN_STEPS", "-5"),
        ("KVQ_DYN_STEPS", "x"),
        ("KVQ_DYN_MAX_SWAPS", "0"),
        ("KVQ_DYN_MARGIN", "0.9"),
        ("KVQ_DYN_MARGIN", "nan"),
        ("KVQ_DYN_MARGIN", "inf"),
        ("KVQ_HOT_GIB", "-1"),
        ("KVQ_HOT_GIB", "lots"),
        ("KVQ_HOT_GIB", "nan"),
        ("KVQ_VRAM_RESERVE_GIB", "-2"),
        ("KVQ_NUMA_POLICY", "interleave"),
        ("KVQ_DYNAMIC", "sometimes"),
    ],
)
def test_garbage_is_refused(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert var in str(info.value) and repr(value) in str(info.value)


def test_child_env_round_trips_bank_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in (load_settings(), load_settings(hot_gib=3.25, dynamic=False, numa_policy="off")):
        env = child_env(s)
        for name, value in env.items():
            if name.startswith("KVQ_"):
                monkeypatch.setenv(name, value)
        assert load_settings() == s


def test_config_check_names_the_knob(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvq", "config", "check"],
        env=env | {"KVQ_DYN_STEPS": "0"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "KVQ_DYN_STEPS" in proc.stderr and "Traceback" not in proc.stderr
