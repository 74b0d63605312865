"""X13's per-request setting: `speculative.n_max` (llama-server's name) reaches the engine as
`SamplingParams.draft_max`; 0 opts out, a bad value is a 400 naming it."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvq import wire
from kvq.api.params import parse
from kvq.errors import ApiError


def _sampling(body: dict[str, object]) -> wire.SamplingParams:
    raw = json.dumps({"model": "m", "prompt": "x", **body}).encode()
    return parse(raw, chat=False, max_tokens_default=4, max_tokens_limit=64).sampling


def test_speculative_n_max_becomes_draft_max() -> None:
    assert _sampling({}).draft_max is None
    assert _sampling({"speculative.n_max": 0}).draft_max == 0
    assert _sampling({"speculative.n_max": 3}).draft_max == 3
    for bad in (-1, 65, "2", True):
        with pytest.raises(ApiError, match="speculative.n_max"):
            _sampling({"speculative.n_max": bad})


def test_draft_max_travels_in_a_v4_request() -> None:
    req = wire.Request(
        request_id="r", model="m", prompt="x", sampling=wire.SamplingParams(draft_max=0)
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=wire.Request)
    assert back.v == wire.REQUEST_VERSION == 4 and back.sampling.draft_max == 0
