"""`kvq api`: an OpenAI-compatible HTTP gateway in front of the Redis streams (`docs/api.md`).

`create_app` loads on first use (PEP 562): `kvq.api.params`, whose ranges `kvq submit` shares,
imports without Starlette."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvq.api.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kvq.api.app import create_app

        return create_app
    raise AttributeError(f"module 'kvq.api' has no attribute {name!r}")
