"""`kvq bench prefill-gap`: what one long prompt does to the token gaps of streams that decode.

In one process, on one GGUF file, through the coordinator's `Engine` (its MoE
computed here, as a coordinator holding the experts computes it): `streams` sequences decode;
two steps in, a prompt of `prompt_tokens` tokens arrives. Each stream's gaps are the times
between its consecutive tokens, over the window from that arrival until the long prompt has
given its first token (the same number of steps in the arm without it). Three arms, run in
this order in the same process so that they see the same machine:

- `alone`: the streams without the long prompt (the baseline);
- `whole`: the prompt read in one step (`KVQ_PREFILL_CHUNK=0`): every stream waits for it;
- `chunked`: the prompt read `chunk` tokens a step (`KVQ_PREFILL_CHUNK`), the streams
  decoding between the chunks.

Reported per arm: p50, p99 and the largest gap (ms), the long prompt's time to first token,
the steps of the window. Prompts are token ids drawn with a fixed seed (any tokenizer).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvq.coordinator.engine import Engine, Sequence
from kvq.errors import ConfigError
from kvq.model import Backbone
from kvq.quant import kernels
from kvq.text import ByteTokenizer

SHORT_PROMPT = 16  # tokens of each decoding stream's prompt
LEAD_STEPS = 2  # decode steps of the streams before the long prompt arrives


@dataclass(frozen=True)
class PrefillGapBench:
    model: str
    streams: int = 8
    prompt_tokens: int = 4096
    chunk: int = 512
    threads: int | None = None
    seed: int = 0

    def check(self, context: int) -> None:
        if self.streams < 1 or self.prompt_tokens < 2 or self.chunk < 1:
            raise ConfigError("--streams, --chunk >= 1 and --prompt-tokens >= 2 are needed")
        need = self.prompt_tokens + 2
        if need > context:
            raise ConfigError(
                f"--prompt-tokens {self.prompt_tokens} needs a context of {need} tokens; "
                f"{self.model} has {context}: ask for fewer"
            )


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _arm(bb: Backbone, cfg: PrefillGapBench, arm: str, steps: int | None) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    vocab = bb.meta.vocab_size
    tok = ByteTokenizer()
    tok.eos_id = -1  # no stream ends early: EOS is ignored, as the other benches do
    engine = Engine(bb, tok, cfg.streams + 1, 0 if arm == "whole" else cfg.chunk)
    budget = cfg.prompt_tokens + 64 * (cfg.prompt_tokens // cfg.chunk + 8)  # never ends first
    for i in range(cfg.streams):
        ids = [rng.randrange(3, vocab) for _ in range(SHORT_PROMPT)]
        engine.admit(f"s{i}", ids, budget, b"")
    long_ids = [rng.randrange(3, vocab) for _ in range(cfg.prompt_tokens)]
    while not all(s.generated for s in engine.active):  # the streams' prefill: not timed
        engine.step(None, lambda _s: None)
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(cfg.streams)}

    def stamp(seqs: list[Sequence]) -> None:
        now = time.perf_counter()
        for s in seqs:
            if s.request_id in times and s.new_token is not None:
                times[s.request_id].append(now)

    for _ in range(LEAD_STEPS):
        engine.step(None, stamp)
    arrived = time.perf_counter()
    long_seq = engine.admit("long", long_ids, 1, b"") if arm != "alone" else None
    first = [len(t) for t in times.values()]  # tokens before the window
    n = 0
    while (steps is None and long_seq is not None and not long_seq.finish) or (
        steps is not None and n < steps
    ):
        engine.step(None, stamp)
        n += 1
    ttft = time.perf_counter() - arrived if long_seq is not None else None
    gaps = [
        (b - a) * 1000
        for (sid, t), k in zip(times.items(), first, strict=True)
        for a, b in zip(t[k - 1 : -1], t[k:], strict=True)
    ]
    return {
        "steps": n,
        "gaps": len(gaps),
        "p50_gap_ms": round(statistics.median(gaps), 1),
        "p99_gap_ms": round(_percentile(gaps, 0.99), 1),
        "max_gap_ms": round(max(gaps), 1),
        "long_ttft_s": None if ttft is None else round(ttft, 2),
    }


def run_prefill_gap_bench(cfg: PrefillGapBench) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    bb = Backbone.from_gguf(Path(cfg.model))
    cfg.check(bb.meta.context_length)
    chunked = _arm(bb, cfg, "chunked", None)
    whole = _arm(bb, cfg, "whole", None)
    alone = _arm(bb, cfg, "alone", chunked["steps"])
    return {
        "config": asdict(cfg),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "int8_activations": kernels.int8_active(),
        "arms": {"alone": alone, "whole": whole, "chunked": chunked},
        "p99_ratio_whole": round(whole["p99_gap_ms"] / alone["p99_gap_ms"], 2),
        "p99_ratio_chunked": round(chunked["p99_gap_ms"] / alone["p99_gap_ms"], 2),
    }
