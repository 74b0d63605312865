"""The bus: Redis connections, streams with consumer groups, dead letters and Lua scripts."""

from kvq.bus.connection import Backoff, connect, is_connection_error
from kvq.bus.scripts import Scripts
from kvq.bus.streams import Consumer, dead_letter, ensure_group, xadd

__all__ = [
    "Backoff",
    "Consumer",
    "Scripts",
    "connect",
    "dead_letter",
    "ensure_group",
    "is_connection_error",
    "xadd",
]
