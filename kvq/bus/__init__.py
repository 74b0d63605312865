"""The bus: Redis connections, streams with consumer groups, dead letters and Lua scripts."""

from kvq.bus.connection import Backoff, connect, connect_async, is_connection_error, redacted_url
from kvq.bus.scripts import Scripts
from kvq.bus.streams import Consumer, Tail, claim_from_dead, dead_letter, ensure_group, xadd

__all__ = [
    "Backoff",
    "Consumer",
    "Scripts",
    "Tail",
    "claim_from_dead",
    "connect",
    "connect_async",
    "dead_letter",
    "ensure_group",
    "is_connection_error",
    "redacted_url",
    "xadd",
]
