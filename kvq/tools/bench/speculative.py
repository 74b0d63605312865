"""`kvq bench speculative`: what n-gram drafts (X13) do for decoding speed. The same
sequences go through the coordinator's `Engine` (one process, local experts) with drafts
(`KVQ_SPECULATIVE=ngram`) and without; rounds alternate drafts, plain, drafts, plain, ... so
a drift of the machine's load hits both sides.

Per count N of `sequences`: N sequences decode up to `tokens` tokens each, greedy (one that
meets EOS ends there, on both sides alike). `tok_s` counts the tokens after each sequence's first over the
time after the first step (the prefill), as `kvq bench structured` does; each figure is the
median over rounds, `speedup` is drafts / plain tok/s of those medians. `acceptance`: the
share of draft tokens the verification kept; `tokens_per_pass`: tokens each sequence got per
forward pass it took part in (1.0 without drafts). `same`: both sides gave every sequence the
same tokens (the exactness X13 promises; false would be a bug).

Random-weight models repeat themselves, which flatters prompt lookup: the acceptance of a
trained model on real text is not measured here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.errors import ConfigError
from kvq.tools.bench.drain import drain, medians

PROMPT = "Write the list again: red, green, blue, red, green, blue, red"


@dataclass(frozen=True, slots=True)
class SpeculativeBench:
    """One `kvq bench speculative` run."""

    model: str
    sequences: tuple[int, ...] = (1, 8)
    tokens: int = 64
    rounds: int = 3
    threads: int = 2
    draft_tokens: int = 4
    prompts: tuple[str, ...] = ()  # sequence i reads prompts[i % len]; (): PROMPT + " i"

    def check(self) -> None:
        """ConfigError naming the first bad value."""
        for name in ("tokens", "rounds", "threads", "draft_tokens"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise ConfigError(f"bench speculative --{flag} {getattr(self, name)} must be >= 1")
        if not self.sequences or min(self.sequences) < 1:
            raise ConfigError("bench speculative --sequences: each count must be >= 1")
        if any(not p for p in self.prompts):
            raise ConfigError("bench speculative --prompts: every prompt must be non-empty")
        if not Path(self.model).is_file():
            raise ConfigError(f"bench speculative --model {self.model!r}: no such file")


def run_speculative_bench(cfg: SpeculativeBench) -> dict[str, Any]:
    """Run the rounds; the `--json` document (see the module docstring)."""
    import torch

    from kvq.coordinator.drafts import DraftPlan
    from kvq.model import Backbone
    from kvq.text import load_tokenizer
    from kvq.tools.bench.prefill import cpu_features

    cfg.check()
    torch.set_num_threads(cfg.threads)
    bb, tok = Backbone.from_gguf(cfg.model), load_tokenizer(cfg.model)
    plans = {"plain": DraftPlan(), "drafts": DraftPlan("ngram", cfg.draft_tokens)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"plain": {}, "drafts": {}}
    same = True
    for n in cfg.sequences:  # warm-up
        _decode(bb, tok, cfg, n, plans["drafts"])
    for _ in range(cfg.rounds):
        for n in cfg.sequences:
            got = {side: _decode(bb, tok, cfg, n, plan) for side, plan in plans.items()}
            same = same and got["plain"]["generated"] == got["drafts"]["generated"]
            for side, r in got.items():
                runs[side].setdefault(str(n), []).append(r)
    plain, drafts = medians(runs["plain"]), medians(runs["drafts"])
    return {
        "model": str(Path(cfg.model).resolve()),
        "tokens": cfg.tokens,
        "rounds": cfg.rounds,
        "threads": torch.get_num_threads(),
        "draft_tokens": cfg.draft_tokens,
        "sequences": list(cfg.sequences),
        "prompts": len(cfg.prompts) or "built-in",
        "cpu": cpu_features(),
        "plain": plain,
        "drafts": drafts,
        "speedup": {n: round(drafts[n]["tok_s"] / plain[n]["tok_s"], 3) for n in plain},
        "same": same,
        "rounds_tok_s": {
            s: {n: [r["tok_s"] for r in rs] for n, rs in v.items()} for s, v in runs.items()
        },
    }


def prompt_of(cfg: SpeculativeBench, i: int) -> str:
    """Sequence i's prompt."""
    return cfg.prompts[i % len(cfg.prompts)] if cfg.prompts else f"{PROMPT} {i}"


def load_prompts(path: str) -> tuple[str, ...]:
    """The prompts of a JSON file holding a list of strings (`--prompts`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"bench speculative --prompts {path!r}: {exc}") from exc
    if not isinstance(data, list) or not data or not all(isinstance(p, str) for p in data):
        raise ConfigError(f"bench speculative --prompts {path!r} must hold a JSON list of strings")
    return tuple(data)


def _decode(bb: Any, tok: Any, cfg: SpeculativeBench, n: int, plan: Any) -> dict[str, Any]:
    """`n` sequences of distinct prompts through a fresh engine, until all are done."""
    from kvq.coordinator.engine import Engine

    engine = Engine(bb, tok, n_slots=n, drafts=plan)
    for i in range(n):
        ids = tok.encode(prompt_of(cfg, i), add_bos=True)
        engine.admit(f"bench-{i}", ids, cfg.tokens, b"")
    run = drain(engine)
    return {
        **run.figures(),
        "acceptance": engine.spec.acceptance,
        "tokens_per_pass": run.tokens / max(run.seq_passes, 1),
        "generated": run.generated,
    }
