"""ACL users on the test server (one per role, named after the test's prefix) and their denials."""

from __future__ import annotations

from collections.abc import Callable

import redis

from kvq.config import Settings
from kvq.keys import Keys
from kvq.security import acl

RoleSettings = Callable[..., Settings]


def role_settings(settings: Settings, r: redis.Redis, made: list[str]) -> RoleSettings:
    """`make(role, worker=None)`: `settings` logged in as that role's ACL user, created now
    with a fresh password; each user's name is appended to `made` (to delete it afterwards)."""
    keys = Keys(settings.prefix)

    def make(role: str, worker: str | None = None) -> Settings:
        user = acl.role_user(keys, role, worker)
        password = acl.apply(r, [user])[user.name]
        made.append(user.name)
        url = acl.user_url(settings.redis_url, user.name, password)
        return settings.model_copy(update={"redis_url": url})

    return make


def denials(r: redis.Redis, prefix: str) -> list[dict[str, object]]:
    """ACL LOG entries (NOPERM) of this test's users (their names start with the prefix)."""
    out = []
    for entry in r.execute_command("ACL", "LOG", "128"):
        e = dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
        e = {(k.decode() if isinstance(k, bytes) else k): v for k, v in e.items()}
        user = e.get("username", b"")
        name = user.decode() if isinstance(user, bytes) else str(user)
        if name.startswith(prefix + "-"):
            out.append(e)
    return out
