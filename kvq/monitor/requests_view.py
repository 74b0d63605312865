"""The dashboard's requests table: what live coordinators generate now (their `inflight`
records, `docs/streams.md`) and, after them, the requests no coordinator has read yet
(`queued`, read from the request streams past their group's last delivered entry)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvq import wire
from kvq.bus.redis_board import RedisBoard
from kvq.bus.streams import entry_ms, never_delivered
from kvq.catalog import ModelInfo
from kvq.errors import WireError
from kvq.keys import COORDINATOR_GROUP, request_streams

REQUESTS_SHOWN = 200  # generating ones, then as many queued ones
QUEUED_SHOWN = 50  # per request stream


def requests_view(
    board: RedisBoard, models: list[str], infos: Mapping[str, ModelInfo | None]
) -> list[dict[str, Any]]:
    """Each request with its age since Redis queued it (`age_s`), generating ones oldest
    first, then queued ones oldest first."""
    now_ms = board.now_ms()
    coords = [c.coord for m in models for c in board.coordinators(m) if c.alive]
    rows = sorted(board.in_flight(coords), key=lambda f: (f.queued_ms, f.request))
    out = [msgspec.structs.asdict(f) for f in rows[:REQUESTS_SHOWN]]
    out += _queued(board, models, infos)[: REQUESTS_SHOWN - len(out)]
    for row in out:
        row["age_s"] = round(max(0.0, now_ms - row["queued_ms"]) / 1000, 1)
    return out


def _queued(
    board: RedisBoard, models: list[str], infos: Mapping[str, ModelInfo | None]
) -> list[dict[str, Any]]:
    """Requests no coordinator has read yet; their prompt tokens are known once one has
    tokenized them (None until then, unless sent as token ids)."""
    found: list[tuple[int, dict[str, Any]]] = []
    for m in models:
        info = infos.get(m)
        for stream in request_streams(board.keys, m, board.shard_count(m)):
            for eid, fields in never_delivered(board.r, stream, COORDINATOR_GROUP, QUEUED_SHOWN):
                try:
                    req = wire.decode(fields, wire.Request)
                except WireError:
                    continue  # a coordinator dead-letters it when it reads it
                queued = entry_ms(eid)
                row = {
                    "request": req.request_id,
                    "model": m,
                    "coordinator": "",
                    "grain": info.grain if info else "",
                    "state": "queued",
                    "prompt_tokens": len(req.prompt_ids) if req.prompt_ids else None,
                    "generated": 0,
                    "max_tokens": req.max_tokens,
                    "queued_ms": queued,
                    "attempt": 0,
                }
                found.append((queued, row))
    return [row for _, row in sorted(found, key=lambda x: x[0])]
