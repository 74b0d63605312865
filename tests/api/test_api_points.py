"""The API points of issue 30, item 6, one test each, with the official `openai` client where it
has the call: `models.retrieve`, the context length in `/v1/models`, 400 for a role OpenAI does
not have, a chat's `max_tokens` defaulting to the room left in the context, `/tokenize` and
`/detokenize` in vLLM's shapes, and the opt-in CORS setting."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import MODEL, System
from openai import OpenAI

from kvq.gguf import read_meta
from kvq.text import load_tokenizer
from kvq.text.chat import load_chat_template

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


@pytest.fixture(scope="module")
def oai(system: System) -> OpenAI:
    return OpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def context(system: System) -> int:
    return read_meta(system.model_path).context_length


def test_models_retrieve_and_the_context_length(oai: OpenAI, context: int) -> None:
    m = oai.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "kvq"
    assert m.model_extra == {"max_model_len": context, "context_length": context}
    listed = oai.models.list().data
    assert [x.model_dump() for x in listed] == [m.model_dump()]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_an_unknown_chat_role_is_400_before_queueing(oai: OpenAI, system: System) -> None:
    before = system.queued()
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "robot", "content": "x"}],  # type: ignore[misc,list-item]
        )
    err = exc.value.body
    assert isinstance(err, dict) and err["param"] == "messages[0].role", err
    assert "robot" in err["message"] and "assistant" in err["message"]
    assert system.queued() == before


def test_chat_max_tokens_defaults_to_the_room_left(
    oai: OpenAI, system: System, context: int
) -> None:
    """vLLM's rule: a chat without max_tokens may fill the context; the tiny model ends at EOS
    or at the context, never at the old default of 16."""
    chat = load_chat_template(system.model_path)
    tok = load_tokenizer(system.model_path)
    messages = [{"role": "user", "content": "tell me everything"}]
    n_prompt = len(tok.encode(chat.render(messages).removeprefix(chat.bos_token)))
    r = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == n_prompt
    room = context - n_prompt
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == room
    else:
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= room
    assert r.usage.completion_tokens > 16, r.usage
    # a completion keeps KVQ_API_MAX_TOKENS_DEFAULT
    c = oai.completions.create(model=MODEL, prompt="tell me everything", temperature=0)
    assert c.usage is not None and c.usage.completion_tokens <= 16


def test_tokenize_and_detokenize_in_vllms_shapes(system: System, context: int) -> None:
    tok = load_tokenizer(system.model_path)
    text = "the quick brown fox"
    r = httpx.post(system.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {
        "count": len(tok.encode(text)),
        "max_model_len": context,
        "tokens": tok.encode(text),
        "token_strs": None,
    }
    plain = httpx.post(
        system.url + "/tokenize",
        json={"model": MODEL, "prompt": text, "add_special_tokens": False},
        timeout=30,
    ).json()
    assert plain["tokens"] == tok.encode(text, add_bos=False)
    chat = httpx.post(
        system.url + "/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": text}]},
        timeout=30,
    ).json()
    assert chat["count"] > body["count"]
    r = httpx.post(
        system.url + "/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}, timeout=30
    )
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    for path, bad, param in (
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens"),
        ("/tokenize", {"model": 7, "prompt": "x"}, "model"),
    ):
        r = httpx.post(system.url + path, json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(system.url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404


def test_cors_is_off_by_default_and_opt_in(system: System) -> None:
    origin = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    off = httpx.get(system.url + "/v1/models", headers=origin, timeout=30)
    assert "access-control-allow-origin" not in off.headers
    url = system.gateway(api_cors_origins="http://app.example")
    pre = httpx.options(
        url + "/v1/chat/completions",
        headers=origin | {"Access-Control-Request-Headers": "authorization,content-type"},
        timeout=30,
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    got = httpx.get(url + "/v1/models", headers={"Origin": "http://app.example"}, timeout=30)
    assert got.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
