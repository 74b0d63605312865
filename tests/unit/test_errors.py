"""Every exception class of kvq is in `kvq.errors`'s tree (STYLE.md habit 5): a subclass of
`KvqError`, drawn in the module's docstring, so that `except KvqError` at an entry point
catches every error kvq raises on purpose and a reader finds them all in one place."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kvq
from kvq import errors


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of kvq, by name."""
    out: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(kvq.__path__, "kvq."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        if info.name == "kvq.quant._qdot":  # the C kernels, loaded with ctypes, no module
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                out[name] = obj
    return out


def test_every_exception_class_is_in_the_tree() -> None:
    found = exception_classes()
    assert "KvqError" in found and "TamperedSource" in found, sorted(found)
    outside = sorted(n for n, c in found.items() if not issubclass(c, errors.KvqError))
    assert not outside, f"exception classes outside KvqError's tree: {outside}"
    undrawn = sorted(n for n in found if n not in (errors.__doc__ or ""))
    assert not undrawn, f"exception classes missing from kvq.errors' docstring: {undrawn}"
