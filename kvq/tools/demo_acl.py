"""`kvq demo --acl`: each demo process logs in as its role's least-privilege user (`kvq.security.acl`).

The users are made for the demo's prefix with fresh passwords on the demo's (admin) connection,
each child gets its role's URL, and the summary counts the `ACL LOG` entries of those users
(`acl_denials`: 0 when every role had what it needed). The users are deleted at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from kvq.keys import Keys
from kvq.security import acl


@dataclass
class DemoUsers:
    """The demo's ACL users: role (or worker id) → login URL."""

    r: redis.Redis
    urls: dict[str, str] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, r: redis.Redis, keys: Keys, url: str, workers: list[str]) -> DemoUsers:
        out = cls(r)
        made = acl.users(keys, ["monitor", "coordinator", "client", "worker"], workers)
        for u, password in zip(made, acl.apply(r, made).values(), strict=True):
            role = u.name.removeprefix(f"{keys.prefix}-worker-") if u.role == "worker" else u.role
            out.urls[role] = acl.user_url(url, u.name, password)
            out.names.append(u.name)
        return out

    def denials(self) -> int:
        """ACL LOG entries of the demo's users."""
        n = 0
        for entry in self.r.execute_command("ACL", "LOG", "128"):
            e = (
                dict(zip(entry[::2], entry[1::2], strict=True))
                if isinstance(entry, list)
                else entry
            )
            user = e.get(b"username", e.get("username", b""))
            n += (user.decode() if isinstance(user, bytes) else str(user)) in self.names
        return n

    def drop(self) -> None:
        if self.names:
            acl.remove(self.r, self.names)
