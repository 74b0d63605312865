"""X17 end to end: concurrent greedy requests through `kvq submit`'s path (`client.generate`),
with a coordinator alone and with workers, give the tokens of `kvq generate` of each prompt
alone, token for token, on each family's tiny model and on the `small` preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvq import client
from kvq.bus import connect
from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env, load_settings
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny
from kvq.tools.synth.presets import preset_named, write_preset

pytestmark = pytest.mark.slow

WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch the rain".split()


def _prompts(n: int) -> list[str]:
    """`n` different prompts of 3 to 40 words."""
    return [
        " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(3 + (i * 7) % 38)) for i in range(n)
    ]


def _alone(model: Path, s: Settings, prompts: list[str], n: int) -> list[list[int]]:
    """What `kvq generate` prints for each prompt alone (its code path, in this process)."""
    bb = Backbone.from_gguf(model)
    tok = load_tokenizer(model)
    return [generate(bb, tok.encode(p), n, chunk=s.prefill_chunk) for p in prompts]


def _served(s: Settings, model_id: str, prompts: list[str], n: int) -> list[list[int]]:
    """Every prompt submitted at once, each from its own client."""

    def one(prompt: str) -> list[int]:
        r = connect(s.bus)
        try:
            return client.generate(
                r, Keys(s.prefix), model_id, prompt=prompt, max_tokens=n, timeout_s=900
            )
        finally:
            r.close()

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _run(
    redis_url: str,
    tmp: Path,
    model: Path,
    workers: int,
    n_req: int,
    n_tok: int,
    chunk: int,
    slice_experts: int = 4,
    speculative: str = "off",
) -> tuple[int, int]:
    """(requests whose served tokens equal the alone ones, requests); `kvq generate` does
    not know the slice grid."""
    model_id = f"det-{model.stem}-{workers}"
    s = load_settings(
        redis_url=redis_url,
        prefix=model_id,
        prefill_chunk=chunk,
        job_deadline_ms=60000,
        slice_experts=slice_experts,
        speculative=speculative,
    )
    kids = Children(child_env(s), log_dir=str(tmp))
    board = open_board(s.bus, s.lifetimes)
    prompts = _prompts(n_req)
    try:
        kids.spawn("monitor", "monitor", "--model", f"{model_id}={model}")
        kids.wait_for(lambda: model_id in board.models(), 300, "registration")
        for i in range(workers):
            kids.spawn(f"w{i}", "worker", "--id", f"w{i}")
        if workers:
            kids.wait_for(
                lambda: sum(v.alive and v.ready for v in board.workers(model_id)) >= workers,
                600,
                "workers serving",
            )
        kids.spawn(
            "coord", "coordinator", "--model", str(model), "--model-id", model_id, "--id", "c1"
        )
        kids.wait_for(lambda: board.coordinator_alive("c1"), 300, "the coordinator")
        served = _served(s, model_id, prompts, n_tok)
    finally:
        kids.stop_all()
    alone = _alone(model, s, prompts, n_tok)
    same = sum(a == b for a, b in zip(served, alone, strict=True))
    print(f"{model.name} workers={workers}: {same} of {n_req} equal", file=sys.stderr)
    return same, n_req


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("workers", [2, 0] if os.environ.get("LONG_TESTS") else [2])
@pytest.mark.parametrize(
    ("arch", "variant", "quant"),
    [
        ("qwen3moe", "", "q4_k_m"),
        ("qwen2moe", "", "f32"),
        ("mixtral", "", "f32"),
        ("olmoe", "", "f32"),
        ("glm4moe", "", "f32"),
        ("deepseek2", "v3", "f32"),
        ("gpt-oss", "", "mxfp4"),
        ("qwen35moe", "", "f32"),
        ("llama4", "", "f32"),
    ],
)
def test_concurrent_requests_equal_each_prompt_alone(
    redis_server,
    tmp_path: Path,
    arch: str,
    variant: str,
    quant: str,
    workers: int,  # type: ignore[no-untyped-def]
) -> None:
    model = tmp_path / f"{arch}.gguf"
    hidden = 256 if quant != "f32" else 64
    make_tiny(
        model,
        arch=arch,
        variant=variant,
        quant=quant,
        layers=3,
        experts=8,
        experts_used=4,  # a slice often holds 2 of a token's experts
        seed=5,
        hidden=hidden,
        expert_ffn=hidden,
    )
    # a 32-token budget: the longer prompts are read in pieces, beside the others' decode;
    # slices of 3 experts (an uneven grid: 3, 3, 2)
    same, n = _run(redis_server.url, tmp_path, model, workers, 12, 16, 32, slice_experts=3)
    assert same == n


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("arch", "variant"), [("qwen3moe", ""), ("deepseek2", "v3"), ("qwen35moe", "")]
)
def test_ngram_drafts_through_the_swarm_equal_each_prompt_alone(
    redis_server,
    tmp_path: Path,
    arch: str,
    variant: str,  # type: ignore[no-untyped-def]
) -> None:
    """X13 at expert grain: with `KVQ_SPECULATIVE=ngram` each sequence's k + 1 rows go to the
    workers as rows of the step's one set of MoE round trips, and every request still gets
    the tokens of plain `kvq generate` of its prompt alone."""
    model = tmp_path / f"{arch}.gguf"
    make_tiny(model, arch=arch, variant=variant, layers=3, experts=8, experts_used=4, seed=5)
    same, n = _run(redis_server.url, tmp_path, model, 2, 8, 24, 32, 3, speculative="ngram")
    assert same == n


@pytest.mark.timeout(3600)
@pytest.mark.skipif(not os.environ.get("LONG_TESTS"), reason="about 14 min each: LONG_TESTS=1")
@pytest.mark.parametrize("workers", [0, 3])
def test_the_small_preset_gives_24_of_24(redis_server, tmp_path: Path, workers: int) -> None:  # type: ignore[no-untyped-def]
    """The deployment of the README: a monitor, one 4-slot coordinator, default settings;
    24 concurrent requests of 48 tokens."""
    model = tmp_path / "small.gguf"
    write_preset(model, preset_named("small"))
    same, n = _run(redis_server.url, tmp_path, model, workers, 24, 48, 512)
    assert same == n


def test_kvq_generate_prints_what_the_test_compares_with(tmp_path: Path) -> None:
    """`_alone` is `kvq generate`'s code path: the command prints the same ids."""
    model = tmp_path / "m.gguf"
    make_tiny(model, seed=5)
    s = load_settings(prefill_chunk=8)
    prompt = _prompts(3)[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvq",
            "generate",
            "--model",
            str(model),
            "--prompt",
            prompt,
            "--max-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=child_env(s),
    )
    assert json.loads(out.stdout)["token_ids"] == _alone(model, s, [prompt], 6)[0]
