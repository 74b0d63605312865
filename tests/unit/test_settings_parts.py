"""Each default is written once (issue 31 item 3): the parts of `Settings` that components take
(`kvq.settings_parts`) hold no defaults; every field is carved from the `Settings` field of its
name, of the name its `From(...)` mark gives, or computed by `Settings`."""

from __future__ import annotations

import dataclasses
import inspect
from typing import get_type_hints

import pytest

from kvq import settings_parts
from kvq.config import Settings, load_settings

PARTS = [
    cls
    for _, cls in inspect.getmembers(settings_parts, inspect.isclass)
    if dataclasses.is_dataclass(cls) and cls.__name__.endswith("Settings")
]
CARVED = {
    "BusSettings": "bus",
    "RoutingSettings": "routing",
    "DispatchSettings": "dispatch",
    "CoordinatorSettings": "coordinator",
    "WorkerSettings": "worker",
    "MonitorSettings": "monitor",
    "ApiSettings": "api",
}


def test_every_part_is_carved_and_has_no_default() -> None:
    assert sorted(c.__name__ for c in PARTS) == sorted(CARVED)
    for cls in PARTS:
        for f in dataclasses.fields(cls):
            assert f.default is dataclasses.MISSING, f"{cls.__name__}.{f.name} has a default"
            assert f.default_factory is dataclasses.MISSING, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("cls", PARTS, ids=lambda c: c.__name__)
def test_a_part_carries_the_settings_values(cls: type) -> None:
    """Every field of a carved part follows its setting: a changed setting shows in the part."""
    base = load_settings()
    for f in dataclasses.fields(cls):
        name, source = f.name, _source(cls, f.name)
        if source is None:  # computed
            continue
        assert source in Settings.model_fields, f"{cls.__name__}.{name}: no setting {source}"
        before = getattr(base, source)
        if isinstance(before, bool) or not isinstance(before, int | float):
            continue
        changed = base.model_copy(update={source: before + 1})
        assert getattr(getattr(changed, CARVED[cls.__name__]), name) == before + 1, name


def _source(cls: type, name: str) -> str | None:
    """The `Settings` field a part's field is carved from (None: computed)."""
    hint = get_type_hints(cls, include_extras=True)[name]
    marks = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, settings_parts.From)]
    if not marks:
        return name
    return marks[0].setting or None


def test_carving_refuses_an_unknown_computed_field() -> None:
    with pytest.raises(TypeError, match="no computed field"):
        load_settings().carve(settings_parts.DispatchSettings, nonsense=1)
