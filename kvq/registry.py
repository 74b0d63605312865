"""Model registration: metadata, the slice table with checksums, and seeded demand (K8).

The monitor registers a model once; workers and coordinators read what it wrote. Everything is
stored as JSON text in hashes so that `redis-cli HGETALL` shows it as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from kvq.bus import Backoff, is_connection_error
from kvq.config import Settings
from kvq.errors import ModelError
from kvq.keys import Keys, slice_id
from kvq.model import ModelMeta, TensorRange, meta_from_dict, meta_to_dict, read_meta, slice_layout

log = logging.getLogger("kvq.registry")


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """A slice: layers [layer_start, layer_end) x experts [expert_start, expert_end)."""

    sid: str
    layer_start: int
    layer_end: int
    expert_start: int
    expert_end: int
    ranges: tuple[TensorRange, ...]  # every tensor range, layer by layer, gate/up/down
    sha256: tuple[str, ...]  # one per range

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    def ranges_of(self, layer: int) -> list[TensorRange]:
        per_layer = len(self.ranges) // (self.layer_end - self.layer_start)
        i = (layer - self.layer_start) * per_layer
        return list(self.ranges[i : i + per_layer])

    def to_json(self) -> str:
        return json.dumps(
            {
                "layers": [self.layer_start, self.layer_end],
                "experts": [self.expert_start, self.expert_end],
                "bytes": self.nbytes,
                "ranges": [
                    {**_range_dict(r), "sha256": h}
                    for r, h in zip(self.ranges, self.sha256, strict=True)
                ],
            }
        )

    @classmethod
    def from_json(cls, sid: str, text: str | bytes) -> SliceSpec:
        d = json.loads(text)
        ranges = tuple(
            TensorRange(
                name=r["name"], kind=r["kind"], offset=r["offset"], nbytes=r["nbytes"],
                ggml_type=r["ggml_type"], expert_shape=tuple(r["expert_shape"]),
            )
            for r in d["ranges"]
        )  # fmt: skip
        return cls(
            sid, d["layers"][0], d["layers"][1], d["experts"][0], d["experts"][1],
            ranges, tuple(r["sha256"] for r in d["ranges"]),
        )  # fmt: skip


def _range_dict(r: TensorRange) -> dict[str, Any]:
    return {
        "name": r.name, "kind": r.kind, "offset": r.offset, "nbytes": r.nbytes,
        "ggml_type": r.ggml_type, "expert_shape": list(r.expert_shape),
    }  # fmt: skip


def plan_slices(
    meta: ModelMeta, path: str | Path, slice_layers: int, slice_experts: int
) -> list[SliceSpec]:
    """Cut the model into slices and checksum every byte range of each."""
    out = []
    with open(path, "rb") as f:
        for ls in range(0, meta.block_count, slice_layers):
            le = min(ls + slice_layers, meta.block_count)
            for es in range(0, meta.expert_count, slice_experts):
                ee = min(es + slice_experts, meta.expert_count)
                ranges = [r for layer in range(ls, le) for r in slice_layout(meta, layer, es, ee)]
                sums = []
                for r in ranges:
                    f.seek(r.offset)
                    sums.append(hashlib.sha256(f.read(r.nbytes)).hexdigest())
                out.append(
                    SliceSpec(slice_id(ls, le, es, ee), ls, le, es, ee, tuple(ranges), tuple(sums))
                )
    return out


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What Redis knows of a registered model."""

    model: str
    source: str
    meta: ModelMeta
    slices: dict[str, SliceSpec]

    def layer_slices(self, layer: int) -> list[SliceSpec]:
        return sorted(
            (s for s in self.slices.values() if s.layer_start <= layer < s.layer_end),
            key=lambda s: s.expert_start,
        )


def register_model(
    r: redis.Redis, keys: Keys, settings: Settings, model: str, path: str | Path,
    source: str | None = None,
) -> ModelInfo:  # fmt: skip
    """Publish a model: metadata, slice table with checksums, and base demand per slice."""
    path = Path(path).resolve()
    meta = read_meta(path)
    slices = plan_slices(meta, path, settings.slice_layers, settings.slice_experts)
    src = source or str(path)
    pipe = r.pipeline(transaction=True)
    pipe.hset(
        keys.model_meta(model),
        mapping={
            "source": src,
            "arch": meta.arch,
            "block_count": meta.block_count,
            "expert_count": meta.expert_count,
            "expert_used_count": meta.expert_used_count,
            "slice_count": len(slices),
            "meta": json.dumps(meta_to_dict(meta)),
        },
    )
    pipe.delete(keys.model_slices(model))
    pipe.hset(keys.model_slices(model), mapping={s.sid: s.to_json() for s in slices})
    pipe.hset(keys.model_target(model), mapping={s.sid: settings.base_replicas for s in slices})
    pipe.execute()
    r.sadd(keys.models(), model)  # another hash slot: not in the transaction (Redis Cluster)
    return ModelInfo(model, src, meta, {s.sid: s for s in slices})


def load_model(r: redis.Redis, keys: Keys, model: str) -> ModelInfo:
    """Read a registered model back, or ModelError if it is not registered."""
    meta_h = r.hgetall(keys.model_meta(model))
    if not meta_h:
        raise ModelError(f"model {model!r} is not registered; run the monitor with --model")
    slices_h = r.hgetall(keys.model_slices(model))
    meta = meta_from_dict(json.loads(meta_h[b"meta"]))
    slices = {k.decode(): SliceSpec.from_json(k.decode(), v) for k, v in slices_h.items()}
    return ModelInfo(model, meta_h[b"source"].decode(), meta, slices)


def list_models(r: redis.Redis, keys: Keys) -> list[str]:
    return sorted(m.decode() for m in r.smembers(keys.models()))


def wait_for_model(
    r: redis.Redis, keys: Keys, model: str, give_up_s: float, backoff_cap_s: float
) -> ModelInfo:
    """`load_model`, retried while Redis is unreachable or the model is not registered yet.

    Lets a coordinator start before the monitor or Redis (compose, systemd); ModelError once
    `give_up_s` has passed.
    """
    deadline = time.monotonic() + give_up_s
    backoff = Backoff(backoff_cap_s)
    while True:
        try:
            return load_model(r, keys, model)
        except (ModelError, redis.RedisError) as exc:
            if isinstance(exc, redis.RedisError) and not is_connection_error(exc):
                raise
            if time.monotonic() > deadline:
                raise ModelError(
                    f"model {model!r} not available after {give_up_s:.0f}s: {exc}"
                ) from None
            if backoff.failures == 0:
                log.info("waiting for model %s (%s)", model, exc)
            backoff.wait()
