"""Lua scripts, one per operation, loaded from `kvq/lua/*.lua` once per client."""

from __future__ import annotations

from importlib import resources

import redis

from kvq.keys import Keys


def _source(name: str) -> str:
    return resources.files("kvq").joinpath("lua", f"{name}.lua").read_text()


class Scripts:
    """The registered scripts of one client; every key goes through KEYS."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._volunteer = r.register_script(_source("volunteer"))
        self._release = r.register_script(_source("release"))
        self._rejoin = r.register_script(_source("rejoin"))
        self._retire = r.register_script(_source("retire"))
        self._lease = r.register_script(_source("lease"))

    def volunteer(
        self, r: redis.Redis, model: str, worker: str, room: int | None = None
    ) -> str | None:
        """Atomically take the rarest slice of `model` with positive demand and at most `room`
        bytes (None: any size), or None."""
        k = self.keys
        keys = [k.model_target(model), k.model_coverage(model), k.model_workers(model)]
        got = self._volunteer(
            keys=[*keys, k.model_slices(model)],
            args=[worker, "" if room is None else max(0, room)],
            client=r,
        )
        return got.decode() if got else None

    def release(self, r: redis.Redis, model: str, worker: str) -> str | None:
        """Atomically give back `worker`'s slice of `model`; returns it, or None."""
        k = self.keys
        got = self._release(
            keys=[k.model_coverage(model), k.model_workers(model)], args=[worker], client=r
        )
        return got.decode() if got else None

    def rejoin(self, r: redis.Redis, model: str, worker: str, sid: str) -> bool:
        """Make sure `worker` is counted as holding `sid`; True if it had to be re-added."""
        k = self.keys
        got = self._rejoin(
            keys=[k.model_coverage(model), k.model_workers(model)], args=[worker, sid], client=r
        )
        return bool(got)

    def retire(self, r: redis.Redis, model: str, worker: str) -> str | None:
        """Release `worker`'s slice only if it is covered beyond target; the slice, or None."""
        k = self.keys
        got = self._retire(
            keys=[k.model_target(model), k.model_coverage(model), k.model_workers(model)],
            args=[worker],
            client=r,
        )
        return got.decode() if got else None

    def lease(self, r: redis.Redis, holder: str, ms: int) -> bool:
        """Take or renew the monitor lease for `ms` (0: drop it if held); True if held now."""
        return bool(self._lease(keys=[self.keys.monitor_lease()], args=[holder, ms], client=r))
