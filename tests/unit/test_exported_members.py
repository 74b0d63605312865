"""The public API of `kvq` and `kvq.swarm`: `__all__` is what the package defines, sorted, and
pinned here, so a change to the public API is a deliberate edit of this file."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest

import kvq
import kvq.swarm

KVQ_API = [
    "BankError",
    "BusError",
    "CapacityError",
    "ConfigError",
    "Keys",
    "KvqError",
    "ModelError",
    "NoRoute",
    "ReplyEvent",
    "RequestFailed",
    "RequestId",
    "RoutingError",
    "ServerError",
    "Settings",
    "SliceIntegrityError",
    "Submitted",
    "TopologyError",
    "UncoveredSlice",
    "UnknownModel",
    "UnknownNode",
    "Unrecoverable",
    "WireError",
    "__version__",
    "connect",
    "events",
    "generate",
    "load_settings",
    "send",
    "submit",
]

SWARM_API = [
    "CostWeights",
    "FailoverOptions",
    "FailoverResult",
    "LivePolicy",
    "LiveRoute",
    "LiveRouter",
    "ModelSpec",
    "NodeProfile",
    "NodeTelemetry",
    "Pipeline",
    "Replacement",
    "Replan",
    "Rescue",
    "Route",
    "RoutingRequest",
    "SimOptions",
    "Slice",
    "Status",
    "Swarm",
    "SwarmConfig",
    "SwarmPlan",
    "SwarmState",
    "Topology",
    "WorkerView",
    "failover_in_swarm",
    "node_cost",
    "parse_nodes",
    "parse_topology",
    "pipeline_cost",
    "place",
    "route_problems",
    "route_request",
    "simulate",
]

PACKAGES = pytest.mark.parametrize(
    ("module", "expected"), [(kvq, KVQ_API), (kvq.swarm, SWARM_API)], ids=["kvq", "kvq.swarm"]
)
INCLUDED_PRIVATE = {"__version__"}


def public_names(module: ModuleType) -> set[str]:
    """Names the package defines for its users: not private, not its submodules (which the
    import system binds as attributes of the package)."""
    return {
        name
        for name in dir(module)
        if (not name.startswith("_") or name in INCLUDED_PRIVATE)
        and not isinstance(getattr(module, name), ModuleType)
    }


@PACKAGES
def test_all_is_pinned_and_sorted(module: ModuleType, expected: list[str]) -> None:
    assert module.__all__ == expected
    assert module.__all__ == sorted(module.__all__)


@PACKAGES
def test_all_is_what_the_package_defines(module: ModuleType, expected: list[str]) -> None:
    assert public_names(module) == set(module.__all__)


@PACKAGES
def test_every_exported_name_resolves(module: ModuleType, expected: list[str]) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {module.__name__} import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(module.__all__)
    assert all(value is not None for value in namespace.values())


def test_lazy_names_are_the_defining_modules_objects() -> None:
    from kvq import client, config, errors
    from kvq.bus import connection

    assert kvq.Settings is config.Settings and kvq.load_settings is config.load_settings
    assert kvq.generate is client.generate and kvq.RequestFailed is client.RequestFailed
    assert kvq.connect is connection.connect
    assert issubclass(kvq.RequestFailed, kvq.KvqError) and kvq.KvqError is errors.KvqError
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvq.nope  # noqa: B018


def test_import_kvq_stays_light() -> None:
    heavy = ("redis", "numpy", "pydantic", "msgspec", "torch")
    code = f"import sys, kvq, kvq.errors; print(sorted(set({heavy!r}) & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", "import kvq loaded: " + proc.stdout
