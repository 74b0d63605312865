"""No body makes `kvq api` answer 500 (issue 32 item 7): hypothesis writes JSON bodies of
OpenAI's parameter names with values of every JSON type (and, half the time, the served model
so the checks past the model lookup run too), against a real system; every answer is below 500
and, when an error, in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import MODEL, System
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # a system of kvq roles or processes

NAMES = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "echo",
    "user",
    "logit_bias",
    "tokens",
    "add_special_tokens",
    "role",
    "content",
]
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
INTS = st.integers(-5, 300) | st.integers(-(2**70), 2**70)
TEXT = st.text(max_size=20)
NEAR = {  # values close to valid ones, so that the checks past the first one run too
    "prompt": TEXT | st.lists(INTS, min_size=1, max_size=5) | st.lists(TEXT, max_size=2),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | VALUES,
                "content": TEXT | VALUES,
            }
        ),
        max_size=3,
    ),
    "tokens": st.lists(INTS, max_size=5),
    "stop_token_ids": st.lists(INTS, max_size=5),
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "max_tokens": INTS,
    "seed": INTS,
    "top_k": INTS,
    "logprobs": INTS | st.booleans(),
    "top_logprobs": INTS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
}
FIELDS = st.sampled_from(NAMES).flatmap(
    lambda n: st.tuples(st.just(n), NEAR[n] | VALUES if n in NEAR else VALUES)
)
BODIES = st.lists(FIELDS, max_size=6).flatmap(
    lambda kv: st.sampled_from([MODEL, MODEL, MODEL, "nope", 3, None]).map(
        lambda m: {**dict(kv), "model": m}
    )
)
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BODIES)
def test_no_body_gets_a_500(system: System, path: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # valid calls stay short
    raw = json.dumps(body, allow_nan=True).encode()
    resp = httpx.post(system.url + path, content=raw, timeout=60)
    assert resp.status_code < 500, (raw[:300], resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
