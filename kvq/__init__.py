"""kvq: serve the routed experts of MoE language models across many machines over Redis streams.

The public API (pinned by tests/unit/test_exported_members.py), enough to send requests:

    import kvq

    settings = kvq.load_settings()  # the KVQ_* environment variables
    r, keys = kvq.connect(settings.bus), kvq.Keys(settings.prefix)
    token_ids = kvq.generate(r, keys, "tiny", prompt="hello", max_tokens=8)

- settings: `Settings`, `load_settings`;
- Redis: `connect` (a client with kvq's reconnect policy), `Keys` (every key name);
- requests: `send` / `submit` (a `RequestId` / `Submitted`: the id with the entry it was
  queued as, so that `events` tells its own refusal from another request's), `events` (yields
  `ReplyEvent`s), `generate`, `RequestFailed`;
- errors: `KvqError` and its tree, drawn in `kvq.errors`.

The roles, the model, the bank and the swarm router are subpackages (`kvq.monitor`,
`kvq.coordinator`, `kvq.worker`, `kvq.model`, `kvq.bank`, `kvq.swarm`), each with its own
`__all__`. Every submodule import runs this file, so it imports only `kvq.errors`; the other
names load on first use (PEP 562), keeping redis, numpy and pydantic out of `import kvq.x`.
"""

import importlib as _importlib
import typing as _typing

from kvq.errors import (
    BankError,
    BusError,
    CapacityError,
    ConfigError,
    KvqError,
    ModelError,
    NoRoute,
    RoutingError,
    ServerError,
    SliceIntegrityError,
    TopologyError,
    UncoveredSlice,
    UnknownModel,
    UnknownNode,
    Unrecoverable,
    WireError,
)

if _typing.TYPE_CHECKING:
    from kvq.bus.connection import connect
    from kvq.client import RequestFailed, RequestId, Submitted, events, generate, send, submit
    from kvq.config import Settings, load_settings
    from kvq.keys import Keys
    from kvq.wire import ReplyEvent

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first access
_LAZY = {
    "Keys": "kvq.keys",
    "ReplyEvent": "kvq.wire",
    "RequestFailed": "kvq.client",
    "RequestId": "kvq.client",
    "Settings": "kvq.config",
    "connect": "kvq.bus.connection",
    "events": "kvq.client",
    "generate": "kvq.client",
    "load_settings": "kvq.config",
    "send": "kvq.client",
    "submit": "kvq.client",
    "Submitted": "kvq.client",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups no longer come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
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
