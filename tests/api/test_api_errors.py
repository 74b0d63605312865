"""Every error status of `kvq api`, in OpenAI's error shape, on a real system: 400 and 404
before anything is queued and without creating keys, 503 with no coordinator, a bounded wait
(504) for a lost request, 429 over the queue limit and under a flood, 401 and the per-key
limit."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, System
from openai import OpenAI
from waiting import wait_for

from kvq import wire
from kvq.bus.records import CoordStats, SlotState

BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
]
BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 9},
        "top_logprobs",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
]


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    return httpx.post(url + path, json=None if content else body, content=content, timeout=30, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err  # type: ignore[no-any-return]


def test_bad_parameters_are_400_and_nothing_is_queued(system: System) -> None:
    before, queued = system.prefix_keys(), system.queued()
    for body, param in BAD_COMPLETIONS:
        err = assert_error(post(system.url, "/v1/completions", {"model": MODEL} | body), 400, param)
        assert err["type"] == "invalid_request_error"
    for body, param in BAD_CHATS:
        assert_error(post(system.url, "/v1/chat/completions", {"model": MODEL} | body), 400, param)
    assert_error(post(system.url, "/v1/completions", b"{not json"), 400, "body")
    oai = OpenAI(base_url=system.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", temperature=9)
    assert system.prefix_keys() == before and system.queued() == queued


def test_unknown_model_is_404_without_keys(system: System) -> None:
    before = system.prefix_keys()
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ):
        err = assert_error(post(system.url, path, body), 404, "model")
        assert err["code"] == "model_not_found"
    oai = OpenAI(base_url=system.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", stream=True)
    assert system.prefix_keys() == before
    assert not system.r.exists(system.keys.model_requests("nope"))
    assert_error(httpx.get(system.url + "/v1/nothing"), 404)


def test_refused_by_the_coordinator_is_400(system: System) -> None:
    """Checks only the coordinator can make (context length, the template's roles) come back
    as the `error` event and become a 400 (streamed or not: before any byte is sent)."""
    long = [65 + i % 26 for i in range(500)]  # + max_tokens > the tiny model's 512 context
    for stream in (False, True):
        body = {"model": MODEL, "prompt": long, "max_tokens": 20, "stream": stream}
        assert (
            "context length"
            in assert_error(post(system.url, "/v1/completions", body), 400)["message"]
        )
    chat = {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}  # OpenAI's, not its
    assert (
        "unknown role"
        in assert_error(post(system.url, "/v1/chat/completions", chat), 400)["message"]
    )
    wait_for(lambda: system.queued() == 0, 20, "refused requests acknowledged")


def test_a_prompt_and_max_tokens_that_fill_the_context_exactly_are_served(
    system: System,
) -> None:
    """511 prompt tokens + 1 fit a 512 context; + 2 do not (vLLM's rule)."""
    ids = [65 + i % 26 for i in range(511)]
    ok = post(system.url, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    usage = ok.json()["usage"]
    assert usage == {"prompt_tokens": 511, "completion_tokens": 1, "total_tokens": 512}
    over = {"model": MODEL, "prompt": ids, "max_tokens": 2}
    refused = assert_error(post(system.url, "/v1/completions", over), 400)
    assert "context length 512" in refused["message"]


def test_no_coordinator_is_503(system: System) -> None:
    system.mon.register("idle", system.model_path)
    resp = post(system.url, "/v1/completions", {"model": "idle", "prompt": "x"})
    assert assert_error(resp, 503)["code"] == "model_not_served"
    assert int(resp.headers["Retry-After"]) >= 1
    assert system.queued("idle") == 0


def haunt(system: System, model: str) -> None:
    """A coordinator of `model` that looks alive (fresh slot state) but never answers."""
    state = SlotState(model=model, busy=0, total=4, ts_ms=int(time.time() * 1000))
    system.mon.board.publish_slots("ghost", state, CoordStats())


@pytest.fixture(scope="module")
def ghost(system: System) -> str:
    """A model whose requests are lost."""
    system.mon.register("lost", system.model_path)
    return "lost"


def test_lost_request_is_answered_within_the_bound_then_the_queue_is_full(
    system: System, ghost: str
) -> None:
    url = system.gateway(api_timeout_s=1.0, api_max_queue=2)
    for stream in (False, True):
        haunt(system, ghost)
        t0 = time.monotonic()
        resp = post(url, "/v1/completions", {"model": ghost, "prompt": "x", "stream": stream})
        assert assert_error(resp, 504)["type"] == "timeout"
        assert time.monotonic() - t0 < 5
    cancels = system.r.xrange(system.keys.model_cancels(ghost))
    assert len(cancels) == 2, "the gateway gave up on them: so does any coordinator"
    assert [wire.decode(f, wire.Cancel).request_id for _, f in cancels]
    # the two lost requests are still queued: over KVQ_API_MAX_QUEUE=2
    haunt(system, ghost)
    resp = post(url, "/v1/completions", {"model": ghost, "prompt": "x"})
    assert assert_error(resp, 429)["code"] == "queue_full"
    assert int(resp.headers["Retry-After"]) >= 1
    assert system.queued(ghost) == 2


def test_flood_gets_429_and_the_rest_is_served(system: System) -> None:
    url = system.gateway(api_max_queue=1)

    def one(i: int) -> tuple[int, str | None, str]:
        body = {
            "model": MODEL,
            "prompt": f"flood {i}",
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status_code, resp.headers.get("Retry-After"), text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    statuses = [s for s, _, _ in got]
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, statuses
    assert all(ra is not None and int(ra) >= 1 for s, ra, _ in got if s == 429)
    assert all(
        text.endswith("data: [DONE]\n\n") and '"length"' in text for s, _, text in got if s == 200
    )


def test_api_keys_and_the_per_key_limit(system: System) -> None:
    keys = ["sk-kvq-test-one", "sk-kvq-test-two"]
    url = system.gateway(api_keys=",".join(keys), api_key_rpm=3)
    assert_error(httpx.get(url + "/v1/models"), 401)
    bad = {"Authorization": "Bearer sk-kvq-wrong-key"}
    assert (
        assert_error(httpx.get(url + "/v1/models", headers=bad), 401)["code"] == "invalid_api_key"
    )
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=url + "/v1", api_key="nope-nope", max_retries=0).models.list()
    one = OpenAI(base_url=url + "/v1", api_key=keys[0], max_retries=0)
    assert [m.id for m in one.models.list().data][0]
    r = one.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 2
    one.models.list()
    with pytest.raises(openai.RateLimitError) as exc:  # the 4th call this minute
        one.models.list()
    assert int(exc.value.response.headers["Retry-After"]) >= 1
    two = OpenAI(base_url=url + "/v1", api_key=keys[1], max_retries=0)
    assert two.models.list().data, "the limit is per key"
    assert httpx.get(url + "/health").status_code == 200, "health needs no key"


def _chunks(total: int, size: int = 64 * 1024) -> Any:
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


def test_a_chunked_body_over_the_cap_is_413_without_reading_it_whole(system: System) -> None:
    """No Content-Length (chunked transfer): the cap holds all the same, nothing is queued."""
    queued = system.queued()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        t0 = time.monotonic()
        resp = httpx.post(system.url + path, content=_chunks(10 << 20), timeout=30)
        assert resp.request.headers.get("transfer-encoding") == "chunked"
        assert_error(resp, 413)
        assert time.monotonic() - t0 < 5, path
    assert system.queued() == queued


@pytest.mark.parametrize("size", [b"FFFFFFFFFFFFFFFF", b"10000000000000000", b"100000"])
def test_a_chunk_that_never_arrives_frees_its_connection(
    system: System, monkeypatch: pytest.MonkeyPatch, size: bytes
) -> None:
    """A chunk declaring 2^64 - 1 (or 2^64, or 1 MiB) bytes, then silence: answered (400 or
    408) within the body deadline, never held open; nothing is queued."""
    import socket
    from urllib.parse import urlsplit

    monkeypatch.setattr("kvq.api.io.BODY_WITHIN_S", 1.0)  # an in-process gateway's
    queued, url = system.queued(), urlsplit(system.gateway())
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\n{"
        )
        t0 = time.monotonic()
        head = s.recv(64)
    assert head.split(b" ")[1] in (b"400", b"408"), head
    assert time.monotonic() - t0 < 5
    assert system.queued() == queued


NESTED = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", NESTED),
    ("/v1/completions", b'{"model": "%s", "prompt": [18446744073709551616]}' % MODEL.encode()),
    ("/v1/completions", b'{"model": "%s", "prompt": [-1]}' % MODEL.encode()),
    ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800 lone"}' % MODEL.encode()),
    (
        "/v1/chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % MODEL.encode(),
    ),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "max_tokens": 1e400}' % MODEL.encode()),
    (
        "/v1/completions",
        b'{"model": "%s", "prompt": "x", "seed": 18446744073709551616}' % MODEL.encode(),
    ),
    (
        "/v1/completions",
        b'{"model": "%s", "prompt": "x", "logit_bias": {"99999999999999999999": 1}}'
        % MODEL.encode(),
    ),
    ("/tokenize", b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode()),
    ("/detokenize", b'{"model": "%s", "tokens": [18446744073709551616]}' % MODEL.encode()),
    ("/v1/completions", b"\xff\xfe not utf-8"),
]


@pytest.mark.parametrize(("path", "body"), MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_inputs_are_4xx_in_openais_shape(system: System, path: str, body: bytes) -> None:
    resp = post(system.url, path, body)
    assert 400 <= resp.status_code < 500, resp.text[:300]
    assert_error(resp, resp.status_code)
