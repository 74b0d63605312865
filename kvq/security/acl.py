"""Least-privilege Redis ACL users, one per role: what each kvq process may touch, and no more.

| role        | user                    | may                                                     |
|-------------|-------------------------|---------------------------------------------------------|
| monitor     | `P-monitor`             | every `P:*` key, the market's scripts                   |
| coordinator | `P-coordinator`         | requests, replies, its own `{c:..}` keys, post jobs to  |
|             |                         | inboxes, read and empty workers' results streams; read  |
|             |                         | the model tables and workers' beats; record and read    |
|             |                         | quarantine verdicts; no other model writes              |
| worker W    | `P-worker-W`            | on each of its own `P:{w:W}:*` keys only the commands   |
|             |                         | of its type and use (no retyping, no `SELECT`); read    |
|             |                         | the model tables; `XADD` to `P:market`; no scripts;     |
|             |                         | its dead letters in `P:{w:W}:dead`; kvq.monitor.quota   |
| client      | `P-client`              | `XADD` requests and cancels, read (and delete) reply    |
|             |                         | streams, read the model list and tables, slot state,    |
|             |                         | the requests' length and groups                         |
| api         | `P-api`                 | the client's rights, and the API keys' call counters    |
|             |                         | (`kvq api`, the one process trusted to count calls)     |

No role but the monitor may list key names (`SCAN`, `KEYS`, `RANDOMKEY`, `CLIENT TRACKING`: its
`BCAST` mode reports every key written); the monitor may `SCAN`, for the quota watch's sweep of
the results streams workers make (`kvq.bus.usage.results_streams`) or read a stream's entries beyond its own (`XINFO STREAM ... FULL`).

`P` is the prefix. ACL key patterns are globs: the prefix is escaped and worker ids are limited to
`[A-Za-z0-9_.-]` (`kvq.keys.check_id`), so `P:{w:W}:*` reaches no other worker's keys. `%R~`/`%W~`
(Redis 7, Valkey) grant read-only or write-only access; a `(...)` selector grants a few commands on
a few keys. `docs/security.md` says what each role can still do and what kvq does not defend.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from kvq.bus.streams import is_cluster
from kvq.errors import ConfigError
from kvq.keys import Keys, check_id

ROLES = ("monitor", "coordinator", "worker", "client", "api")
# no role lists key names: SCAN and KEYS, RANDOMKEY, CLIENT TRACKING (BCAST reports every key)
_NO_LISTING = ["-scan", "-keys", "-randomkey", "-client|tracking"]
# every role: no admin, no server-wide or destructive command, no pub/sub, no key listing
_SAFE = ["+@all", "-@dangerous", "-@admin", "-@pubsub", *_NO_LISTING]
_READ = ["+smembers", "+sismember", "+hgetall", "+hget", "+hmget", "+hkeys", "+exists"]
# connecting, and the server's clock (`TIME`: ages and liveness measured on Redis's clock)
_CONNECT = [
    "+ping",
    "+hello",
    "+auth",
    "+client|setinfo",
    "+client|setname",
    "+acl|whoami",
    "+time",
]
# the monitor's quota watch (kvq.monitor.quota): list worker users and their connections, and
# disable one over its quota (`ACL SETUSER` makes the monitor's user as trusted as an admin)
# the monitor's quota watch (`kvq.monitor.quota`); `SCAN` for its sweep of the results streams
# a worker's user may make under any coordinator id (after _NO_LISTING, which refuses it)
_QUOTA_WATCH = ["+acl|users", "+acl|setuser", "+client|list", "+client|kill", "+scan"]


@dataclass(frozen=True, slots=True)
class AclUser:
    """One ACL user: its name and its rules (without the password)."""

    role: str
    name: str
    rules: tuple[str, ...]

    def setuser(self, password: str | None = None) -> list[str]:
        """`ACL SETUSER` arguments; `password` None prints a placeholder."""
        secret = f">{password}" if password is not None else "><PASSWORD>"
        return ["ACL", "SETUSER", self.name, "reset", "on", secret, "resetchannels", *self.rules]


def _glob(text: str) -> str:
    """`text` literal inside an ACL key pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _model_tables(p: str) -> list[str]:
    return [
        f"%R~{p}:models",
        f"%R~{p}:{{m:*}}:meta",
        f"%R~{p}:{{m:*}}:slices",
        f"%R~{p}:{{m:*}}:removed",  # `kvq model rm`: a worker stops serving it
    ]


def user_name(prefix: str, role: str, worker: str | None = None) -> str:
    return f"{prefix}-worker-{check_id('worker id', worker)}" if worker else f"{prefix}-{role}"


def role_user(keys: Keys, role: str, worker: str | None = None) -> AclUser:
    """The ACL user of `role` under `keys.prefix` (`worker` names the worker for that role)."""
    p = _glob(keys.prefix)
    if role == "monitor":
        rules = _monitor_rules(p)
    elif role == "coordinator":
        rules = _coordinator_rules(p)
    elif role == "worker":
        if worker is None:
            raise ConfigError("the worker role needs a worker id (kvq acl --worker ID)")
        rules = _worker_rules(p, check_id("worker id", worker))
    elif role in ("client", "api"):
        rules = _client_rules(p, api=role == "api")
    else:
        raise ConfigError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return AclUser(
        role, user_name(keys.prefix, role, worker if role == "worker" else None), tuple(rules)
    )


def _monitor_rules(p: str) -> list[str]:
    """Every key under the prefix; RQ's coarse jobs (kvq.monitor.coarse) on the same server:
    its `rq:*` keys, its worker's command channel, and INFO (it reads the server's version)."""
    return [
        f"~{p}:*",
        "~rq:*",
        "resetchannels",
        "&rq:*",
        "+@all",
        "-@dangerous",
        "-@admin",
        *_NO_LISTING,
        "+info",
        *_QUOTA_WATCH,
    ]


def _coordinator_rules(p: str) -> list[str]:
    """Its own requests, replies and slot records; workers' inboxes written, their beats read."""
    return [
        *_model_tables(p),
        f"%R~{p}:{{m:*}}:workers",
        f"%R~{p}:{{m:*}}:cancel",
        f"%R~{p}:{{m:*}}:state",
        f"~{p}:{{m:*}}:requests",
        f"~{p}:{{m:*}}:routed",
        f"~{p}:{{m:*}}:coordinators",
        f"~{p}:{{m:*}}:quarantine",
        f"~{p}:{{m:*}}:verdicts",
        f"~{p}:{{c:*}}:*",
        f"%W~{p}:{{w:*}}:inbox",
        f"%R~{p}:{{w:*}}:hb",
        f"%R~{p}:{{w:*}}:info",
        f"~{p}:{{w:*}}:results:*",
        f"~{p}:{{r:*}}:reply",
        f"~{p}:{{r:*}}:run",
        f"%R~{p}:{{r:*}}:cancel",
        f"%W~{p}:deadletter",
        *_SAFE,
        "-@scripting",
    ]


def _client_rules(p: str, api: bool) -> list[str]:
    """A client's, and with `api` the gateway's: send, cancel and read its own requests."""
    rules = [
        "resetkeys",
        "-@all",
        *_CONNECT,
        f"(%W~{p}:{{m:*}}:requests %W~{p}:{{m:*}}:cancel +xadd)",
        f"(%W~{p}:{{r:*}}:cancel +set)",  # a request's own cancel (`kvq.client.cancel`)
        # `kvq api` deletes a reply stream it has read to its end (its only reader)
        f"(~{p}:{{r:*}}:reply +xread +xrange +xrevrange +xlen +exists +pttl +ttl +del)",
        f"({' '.join([*_model_tables(p), f'%R~{p}:{{m:*}}:coordinators', *_READ])})",
        # the queue's length and its group's lag; no XINFO STREAM (its FULL form lists the
        # queued requests of everyone: prompts, ids)
        # XPENDING: whether its own queued request is still there (`kvq.client.events`)
        f"(%R~{p}:{{m:*}}:requests +xlen +xinfo|groups +xinfo|consumers +xpending)",
        # the gateway's queue watch: slot state, and the token counters of its stats
        f"(%R~{p}:{{c:*}}:slots %R~{p}:{{c:*}}:stats +hgetall +hget +exists)",
    ]
    if api:  # redis-py's INCR sends INCRBY
        rules.append(f"(~{p}:{{k:*}}:calls +set +incr +incrby +pttl)")
    return rules


def _worker_rules(p: str, w: str) -> list[str]:
    """Worker `w`'s rules: on each of its own keys only the commands of that key's type and use
    (so no key can be made another type: `SET` only on its beat, no `SELECT`, no script), the
    model tables read, and `XADD` to the doorbell. Redis cannot bound what one `XADD` or `SET`
    holds, or an `XADD`'s `MAXLEN`: the monitor measures what its keys hold
    (`kvq.monitor.quota`), moves its dead letters to the shared stream, and answers its asks
    whether or not the doorbell it rang is still there."""
    own = f"{p}:{{w:{w}}}"
    tables = " ".join([*_model_tables(p), f"%R~{p}:{{m:*}}:workers", *_READ])
    return [
        "resetkeys",
        "-@all",
        *_CONNECT,
        f"(~{own}:hb +set +get +getrange +exists)",  # its beat: a string with an expiry
        f"(~{own}:info +hset +hmget +expire +exists)",  # its record: a hash
        # its inbox: coordinators post jobs; it reads, acks and deletes them, never adds one
        f"(~{own}:inbox +xgroup|create +xreadgroup +xack +xdel +xlen +xrange +exists)",
        # its results, market asks and dead letters (the monitor moves those to the shared
        # stream: one XADD ... MAXLEN 0 there would erase every role's)
        f"(~{own}:results:* ~{own}:asks ~{own}:dead +xadd +expire)",
        f"(~{own}:answers +xread +xdel)",  # the monitor's answers, deleted once read
        f"(~{own}:* +del)",  # dropped as it leaves; each key comes back only as its own type
        f"({tables})",
        f"(%W~{p}:market +xadd)",  # the doorbell (the monitor also sweeps every asks stream)
    ]


def disable(r: redis.Redis, name: str) -> int:
    """Turn user `name` off and close its connections (on every node); how many were closed."""
    _everywhere(r, "ACL", "SETUSER", name, "off")
    if is_cluster(r):
        got = r.execute_command("CLIENT", "KILL", "USER", name, target_nodes="all")
        return sum(int(v) for v in got.values()) if isinstance(got, dict) else int(got)
    return int(r.execute_command("CLIENT", "KILL", "USER", name))


def users(keys: Keys, roles: list[str], workers: list[str]) -> list[AclUser]:
    """The users of `roles` (every role when empty), one per worker id for the worker role."""
    out = []
    if "worker" in roles and not workers:
        raise ConfigError("--role worker needs at least one --worker ID (one user per worker)")
    for role in roles or list(ROLES):
        if role == "worker":
            out += [role_user(keys, role, w) for w in workers]
        else:
            out.append(role_user(keys, role))
    return out


def apply(r: redis.Redis, acl_users: list[AclUser]) -> dict[str, str]:
    """Create (or reset) each user with a new random password; user name → password. On a
    Redis Cluster every node keeps its own users: each is set on all nodes."""
    made = {}
    for u in acl_users:
        password = secrets.token_urlsafe(24)
        _everywhere(r, *u.setuser(password))
        made[u.name] = password
    return made


def remove(r: redis.Redis, names: Iterable[str]) -> None:
    """Delete these users (from every node of a cluster)."""
    names = list(names)
    if names:
        _everywhere(r, "ACL", "DELUSER", *names)


def _everywhere(r: redis.Redis, *command: str) -> None:
    if is_cluster(r):  # redis-py sends ACL commands to one node by default
        r.execute_command(*command, target_nodes="all")
    else:
        r.execute_command(*command)


def node_pool(r: redis.Redis) -> redis.ConnectionPool:
    """A connection pool of one server: `r`'s own, or a cluster's default node's."""
    if is_cluster(r):
        node = r.get_default_node()
        pool: redis.ConnectionPool = node.redis_connection.connection_pool
        return pool
    return r.connection_pool


def user_url(url: str, user: str, password: str) -> str:
    """`url` logging in as `user` with `password` (any credentials it had replaced)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    cred = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    return urlunsplit(parts._replace(netloc=cred + host))
