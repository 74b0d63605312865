"""Lua scripts, one per operation, loaded from `kvq/lua/*.lua` once per client."""

from __future__ import annotations

from collections.abc import Collection
from importlib import resources

import redis

from kvq.keys import Keys, join_slices, split_slices


def _source(name: str) -> str:
    return resources.files("kvq").joinpath("lua", f"{name}.lua").read_text()


def _market(name: str) -> str:
    """A market script with the helpers it shares (`slices.lua`) in front."""
    return _source("slices") + _source(name)


class Scripts:
    """The registered scripts of one client; every key goes through KEYS."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._volunteer = r.register_script(_market("volunteer"))
        self._release = r.register_script(_market("release"))
        self._rejoin = r.register_script(_market("rejoin"))
        self._retire = r.register_script(_market("retire"))
        self._lease = r.register_script(_source("lease"))

    def volunteer(
        self,
        r: redis.Redis,
        model: str,
        worker: str,
        room: int | None = None,
        held: Collection[str] = (),
    ) -> str | None:
        """Atomically take a slice of `model` with positive demand and at most `room` bytes
        (None: any size) that `worker` does not hold, or None: an uncovered one first, then
        the hottest (`volunteer.lua`). `held`: the slice ids it knows it holds; one listed for
        it beyond those (a lost answer) comes back first."""
        k = self.keys
        keys = [k.model_target(model), k.model_coverage(model), k.model_workers(model)]
        got = self._volunteer(
            keys=[*keys, k.model_slices(model), k.model_routed(model)],
            args=[worker, "" if room is None else max(0, room), join_slices(held)],
            client=r,
        )
        return got.decode() if got else None

    def release(
        self, r: redis.Redis, model: str, worker: str, sid: str | None = None
    ) -> tuple[str, ...]:
        """Atomically give back `worker`'s slice `sid` of `model` (None: all of them); the
        slice ids released, () when it held none of them."""
        k = self.keys
        got = self._release(
            keys=[k.model_coverage(model), k.model_workers(model)],
            args=[worker, sid or ""],
            client=r,
        )
        return split_slices(got) if got else ()

    def rejoin(self, r: redis.Redis, model: str, worker: str, *sids: str) -> int:
        """Make sure `worker` is counted as holding each of `sids`; how many were re-added."""
        if not sids:
            return 0
        k = self.keys
        got = self._rejoin(
            keys=[k.model_coverage(model), k.model_workers(model)],
            args=[worker, *sids],
            client=r,
        )
        return int(got or 0)

    def retire(self, r: redis.Redis, model: str, worker: str, sid: str) -> str | None:
        """Release `worker`'s slice `sid` only if it is covered beyond target; it, or None."""
        k = self.keys
        got = self._retire(
            keys=[k.model_target(model), k.model_coverage(model), k.model_workers(model)],
            args=[worker, sid],
            client=r,
        )
        return got.decode() if got else None

    def lease(self, r: redis.Redis, holder: str, ms: int) -> bool:
        """Take or renew the monitor lease for `ms` (0: drop it if held); True if held now."""
        return bool(self._lease(keys=[self.keys.monitor_lease()], args=[holder, ms], client=r))
