"""`kvq api`: an OpenAI-compatible HTTP gateway in front of the Redis streams (`docs/api.md`)."""

from kvq.api.app import create_app

__all__ = ["create_app"]
