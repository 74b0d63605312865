"""Per-worker quotas where Redis cannot enforce them (X3): what each worker's ACL user makes the
server hold, measured by the active monitor every second, and the user disabled when over.

A worker's user (`kvq acl --role worker`) may run on each of its own keys only the commands of
that key's type, but Redis cannot bound what one `SET` or `XADD` holds, how many entries it
appends, or how many connections one user opens. So the monitor measures, per worker user
(`ACL USERS`):

| what                                        | quota                                        |
|---------------------------------------------|----------------------------------------------|
| connections under its user (`CLIENT LIST`)  | `CONNECTIONS` (32)                           |
| `P:{w:W}:hb` (`MEMORY USAGE`)               | `HB_BYTES` (4 KiB: a 512-byte instance token)|
| `P:{w:W}:info`                              | `INFO_BYTES` (1 MiB: `WorkerInfo`'s bounds)  |
| entries of `results:C` (each C seen, and    | 2 x `KVQ_STREAM_MAXLEN` (it trims to 1 x)    |
| any other a sweep finds), `asks`, `dead`    |                                              |
| consumers in its inbox's group              | `CONSUMERS` (4: it reads as itself)          |
| `hb` + `info` + `asks` + `dead` + results   | `KVQ_WORKER_QUOTA_MIB`                       |

A user over any of them is turned off (`ACL SETUSER U off`: no new login), its connections are
closed (`CLIENT KILL USER U`) and the keys it wrote are deleted (its beat goes: the monitor's
reap moves its inbox's jobs to a peer), in one log line. The operator turns it on again with
`ACL SETUSER U on` or a new `kvq acl --apply`.

Dead letters: a worker's user writes its own, `P:{w:W}:dead` (bounded like its other streams),
and each pass moves them to `P:deadletter` with the worker's id (`kvq.bus.deadletters.relay`):
no worker may write the shared stream, where one `XADD ... MAXLEN 0` would erase every role's.
The coordinators and trusted workers write it directly; `dead_letter` keeps each entry under
`DEAD_FIELDS_BYTES`, and the watch deletes any entry over `DEAD_ENTRY_BYTES` as it reads the
stream (`DeadLetterWatch`).

Asks: each pass lists the workers whose `asks` stream holds entries (`take_asking`), and the
market answers them whether or not their doorbell (`P:market`, which any worker may trim) is
still there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from kvq.bus.deadletters import relay
from kvq.bus.streams import DEAD_FIELDS_BYTES
from kvq.bus.usage import Usage, connections_by_user, measure, results_streams
from kvq.keys import Keys
from kvq.security import acl

log = logging.getLogger("kvq.monitor.quota")

CONNECTIONS = 32  # an honest worker holds a few (its threads' pool); volunteer proofs add one
HB_BYTES = 4 << 10
INFO_BYTES = 1 << 20
CONSUMERS = 4
DEAD_ENTRY_BYTES = 2 * DEAD_FIELDS_BYTES  # the copied fields, the reason and the names
_DEAD_BATCH = 64  # dead letters read per pass
# how often every worker's results streams are listed (`SCAN`): a worker's user may create one
# per coordinator id it likes, which the per-second pass (the coordinators seen) cannot name
SWEEP_S = 5.0


@dataclass(frozen=True, slots=True)
class Quota:
    """What one worker's user may make Redis hold (the table above)."""

    key_bytes: int  # KVQ_WORKER_QUOTA_MIB
    entries: int  # per stream it writes: twice the MAXLEN its honest writes trim to
    connections: int = CONNECTIONS


def over(u: Usage, q: Quota) -> str | None:
    """Why usage `u` is over quota `q`; None when within it."""
    checks = [
        (u.connections, q.connections, "connections"),
        (u.hb_bytes, HB_BYTES, "bytes in its beat"),
        (u.info_bytes, INFO_BYTES, "bytes in its record (info)"),
        (u.key_bytes, q.key_bytes, "bytes in its keys (KVQ_WORKER_QUOTA_MIB)"),
        (u.consumers, CONSUMERS, "consumers in its inbox's group"),
        *((n, q.entries, f"entries in {s}") for s, n in u.entries.items()),
    ]
    return next((f"{got} {what} > {cap}" for got, cap, what in checks if got > cap), None)


class QuotaWatch:
    """One pass (`check`) measures every worker user and disables those over quota."""

    def __init__(
        self, r: redis.Redis, keys: Keys, quota: Quota, coordinators: Callable[[], Iterable[str]]
    ) -> None:
        self.r, self.keys, self.quota, self.coordinators = r, keys, quota, coordinators
        self.user_prefix = acl.user_name(keys.prefix, "worker", "x")[:-1]
        self.disabled: list[str] = []  # users, in the order they were turned off
        self.coords: set[str] = set()  # every coordinator seen: results streams may outlive it
        self.dead = DeadLetterWatch(r, keys)
        self.relayed = 0  # dead letters moved from workers' own streams to the shared one
        self.found: dict[str, list[str]] = {}  # worker -> its results streams, as last swept
        self._swept = float("-inf")
        self.asking: list[str] = []  # workers with asks in their stream, as of the last pass

    def check(self) -> list[str]:
        """Measure every worker user; the users disabled by this pass."""
        workers = [
            _s(u)[len(self.user_prefix) :]
            for u in self.r.execute_command("ACL", "USERS")
            if _s(u).startswith(self.user_prefix)
        ]
        self.dead.check()
        if not workers:
            return []
        conns = connections_by_user(self.r)
        self.coords.update(self.coordinators())
        coords = sorted(self.coords)
        if time.monotonic() - self._swept >= SWEEP_S:
            self.found, self._swept = results_streams(self.r, self.keys), time.monotonic()
        out, asking = [], []
        self._sweep_disabled()
        for w in workers:
            if self.user_prefix + w in self.disabled:
                continue
            n = conns.get(self.user_prefix + w, 0)
            usage = measure(self.r, self.keys, w, coords, n, self.found.get(w, ()))
            why = over(usage, self.quota)
            if why is not None:
                self._disable(usage, why)
                out.append(self.user_prefix + w)
                continue
            if usage.entries.get(self.keys.worker_dead(w)):
                self._relay(w)
            if usage.entries.get(self.keys.worker_asks(w)):
                asking.append(w)
        self.asking = asking
        return out

    def _sweep_disabled(self) -> None:
        """Delete what the sweep still finds of a disabled user's results streams (those it
        made between the sweep and its turning off)."""
        for user in self.disabled:
            left = self.found.pop(user[len(self.user_prefix) :], [])
            if left:
                self.r.delete(*left)  # one hash tag: one slot

    def take_asking(self) -> list[str]:
        """The workers whose asks the last pass found waiting (once): the market answers them
        even where the doorbell they rang was trimmed away (`XADD P:market MAXLEN 0`)."""
        got, self.asking = self.asking, []
        return got

    def _relay(self, worker: str) -> None:
        moved, dropped = relay(self.r, self.keys, worker, 2 * self.quota.entries, DEAD_ENTRY_BYTES)
        self.relayed += moved
        if dropped:
            log.warning(
                "dropped %d dead letters of worker %s over %d bytes (dead_letter writes "
                "none: its own XADD)",
                dropped,
                worker,
                DEAD_ENTRY_BYTES,
            )

    def _disable(self, usage: Usage, why: str) -> None:
        user = self.user_prefix + usage.worker
        killed = acl.disable(self.r, user)
        if usage.written:
            self.r.delete(*usage.written)  # one hash tag: one slot
        self.disabled.append(user)
        log.warning(
            "disabled ACL user %s (worker %s): %s; closed %d connections, deleted %d keys; "
            "to let it in again: ACL SETUSER %s on (or kvq acl --apply)",
            user,
            usage.worker,
            why,
            killed,
            len(usage.written),
            user,
        )


class DeadLetterWatch:
    """Reads `P:deadletter` forward, `_DEAD_BATCH` entries a pass, and deletes each entry over
    `DEAD_ENTRY_BYTES` (no `dead_letter` writes one: someone's raw `XADD`)."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.key = r, keys.deadletter()
        self.cursor = "0-0"
        self.deleted = 0

    def check(self) -> int:
        """Delete the oversized entries among the next ones; how many."""
        got = self.r.xrange(self.key, f"({self.cursor}", "+", count=_DEAD_BATCH)
        if not got:
            return 0
        self.cursor = _s(got[-1][0])
        big = [(eid, n) for eid, fields in got if (n := _entry_bytes(fields)) > DEAD_ENTRY_BYTES]
        if big:
            self.r.xdel(self.key, *[eid for eid, _ in big])
            self.deleted += len(big)
            log.warning(
                "deleted %d dead letters over %d bytes (the largest %d; no kvq role writes one, "
                "and Redis ACLs cannot bound an XADD: a worker's own XADD)",
                len(big),
                DEAD_ENTRY_BYTES,
                max(n for _, n in big),
            )
        return len(big)


def _entry_bytes(fields: dict[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
