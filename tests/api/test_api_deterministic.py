"""X17 through the gateway: greedy completions sent at once, batched together by the engine
(4 slots, a worker serving expert slices), equal each prompt sent alone, token for token."""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import MODEL, System

pytestmark = pytest.mark.slow  # a system of kvq roles or processes

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
PROMPTS = [f"{w} and the rest of it" for w in WORDS]


def _complete(url: str, prompt: str) -> list[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["logprobs"]["tokens"])


def test_concurrent_greedy_completions_equal_each_prompt_alone(system: System) -> None:
    alone = {p: _complete(system.url, p) for p in PROMPTS}
    together: dict[str, list[str]] = {}

    def one(p: str) -> None:
        together[p] = _complete(system.url, p)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    assert all(len(v) == 24 for v in alone.values())
