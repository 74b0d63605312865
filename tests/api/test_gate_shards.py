"""`kvq api`'s admission with request shards (issue 14), on a real server: each call goes to its
request id's shard, and the queue limit counts every shard."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvq import wire
from kvq.api.gate import Gate
from kvq.api.params import Call
from kvq.bus.records import CoordStats, SlotState
from kvq.config import Settings
from kvq.errors import ApiError
from kvq.keys import request_shard, request_streams
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny


def test_calls_go_to_their_shard_and_429_counts_every_shard(
    settings: Settings, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"request_shards": 3, "api_max_queue": 6})
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=4, experts_used=2)
    mon = Monitor.from_settings(s)
    mon.register("m", model)
    board = mon.board
    state = SlotState(model="m", busy=0, total=4, ts_ms=int(time.time() * 1000))
    board.publish_slots("c1", state, CoordStats())  # a live coordinator: no 503
    gate = Gate(board, s.api)
    call = Call(chat=False, model="m", max_tokens=2, sampling=wire.SamplingParams(), prompt="x")
    streams = request_streams(board.keys, "m", 3)
    subs = [gate.admit(call) for _ in range(6)]
    for sub in subs:
        on_shard = {
            eid.decode() for eid, _ in board.r.xrange(streams[request_shard(sub.request_id, 3)])
        }
        assert sub.entry in on_shard, "on the shard its id names"
    assert sum(board.r.xlen(st) for st in streams) == 6
    with pytest.raises(ApiError) as err:
        gate.admit(call)
    assert err.value.status == 429 and "6 requests waiting" in str(err.value)
