"""`kvq api` chat on each newer family: one system serving tiny olmoe, glm4moe and deepseek2
models at once (a coordinator each), one gateway, the official `openai` client. Each chat
completion's text is the greedy continuation of the file's chat template rendered, computed
here without Redis."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_gateway
from openai import OpenAI
from waiting import wait_for

from kvq.config import load_settings
from kvq.coordinator import Coordinator
from kvq.local.server import EmbeddedRedis
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.monitor import Monitor
from kvq.text import load_tokenizer
from kvq.text.chat import load_chat_template
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow  # a system of kvq roles or processes

FAMILIES = {
    "olmoe": ("olmoe", ""),
    "glm": ("glm4moe", ""),
    "dsv3": ("deepseek2", "v3"),
    "dsv2lite": ("deepseek2", "v2-lite"),
}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def families(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, Path]]]:
    d = tmp_path_factory.mktemp("families")
    paths = {}
    for model, (arch, variant) in FAMILIES.items():
        paths[model] = d / f"{model}.gguf"
        make_tiny(paths[model], arch=arch, variant=variant, layers=3, tokenizer="bpe", seed=7)
    s = load_settings(
        redis_url=redis_server.url,
        prefix=f"f{uuid.uuid4().hex[:10]}",
        block_ms=100,
        heartbeat_ttl_s=1.0,
        monitor_poll_s=0.1,
        slot_poll_s=0.02,
        n_slots=2,
        api_timeout_s=60.0,
    )
    mon = Monitor.from_settings(s)
    coords = []
    for model, path in paths.items():
        mon.register(model, path)
        coords.append(Coordinator.from_settings(s, f"c-{model}", model, path))
    threads = [threading.Thread(target=c.run, daemon=True) for c in coords]
    for t in threads:
        t.start()
    gw = start_gateway(s, d / "api.log")
    for model in paths:
        wait_for(lambda m=model: any(c.alive for c in mon.board.coordinators(m)), 20, model)
    yield gw.url, paths
    gw.stop()
    for c in coords:
        c.stop.set()
    for t in threads:
        t.join(timeout=10)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_chat_on_each_family_is_its_template_continued(
    families: tuple[str, dict[str, Path]], model: str
) -> None:
    url, paths = families
    oai = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    path = paths[model]
    tok = load_tokenizer(path)
    prompt = load_chat_template(path).render(MESSAGES, add_generation_prompt=True)
    want = tok.decode(generate(Backbone.from_gguf(path), tok.encode(prompt), 6))
    assert r.choices[0].message.content == want
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(prompt))
