"""`kvq bench structured`: what the grammar mask of structured output costs. The same
sequences go through the coordinator's `Engine` (one process, local experts) with and without
a JSON schema, compiled as `kvq api` compiles `response_format: json_schema`; rounds alternate
schema, plain, schema, plain, ... so a drift of the machine's load hits both sides.

Per count N of `sequences`: N sequences decode up to `tokens` tokens each, greedy, under the
schema; the plain side then decodes the very same tokens without it (the schema side's tokens
forced, as a restarted request replays what it streamed), so both sides run the same model
work (the same experts routed, the same batch at every step) and differ by the mask alone.
`tok_s` counts the tokens after each sequence's first over the time after the first step (the
prefill), as `kvq bench model`'s aggregates do; each figure is the median over rounds,
`ratio` is schema / plain tok/s of those medians (1.0: the mask is free) and
`ratio_paired_median` the median of each round's own ratio. `mask_ms_per_step`: the time the
schema side's steps spent shaping the logits (the mask of every row, computed in one parallel
llguidance call, and applied), and `mask_share` its share of the schema side's decode time:
the figure that a busy machine moves least. The default schema cannot be complete within `tokens` tokens
(an array of at least `tokens` strings), so no sequence ends early. `admit_ms`: the median
time to admit one constrained sequence (its matcher built from the compiled grammar), paid
once per request.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.errors import ConfigError
from kvq.tools.bench.drain import drain, medians

PROMPT = "Answer in JSON: the weather of the next days"


def default_schema(tokens: int) -> dict[str, Any]:
    """A schema no sequence can complete within `tokens` tokens."""
    return {
        "type": "object",
        "properties": {"days": {"type": "array", "items": {"type": "string"}, "minItems": tokens}},
        "required": ["days"],
    }


@dataclass(frozen=True, slots=True)
class StructuredBench:
    """One `kvq bench structured` run."""

    model: str
    schema: str | None = None  # a JSON schema file; None: `default_schema(tokens)`
    sequences: tuple[int, ...] = (1, 8)
    tokens: int = 32
    rounds: int = 3
    threads: int = 2

    def check(self) -> None:
        """ConfigError naming the first bad value."""
        for name in ("tokens", "rounds", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench structured --{name} {getattr(self, name)} must be >= 1")
        if not self.sequences or min(self.sequences) < 1:
            raise ConfigError("bench structured --sequences: each count must be >= 1")
        if not Path(self.model).is_file():
            raise ConfigError(f"bench structured --model {self.model!r}: no such file")
        if self.schema is not None and not Path(self.schema).is_file():
            raise ConfigError(f"bench structured --schema {self.schema!r}: no such file")

    def schema_text(self) -> str:
        if self.schema is None:
            return json.dumps(default_schema(self.tokens))
        return Path(self.schema).read_text()


def run_structured_bench(cfg: StructuredBench) -> dict[str, Any]:
    """Run the rounds; the `--json` document (see the module docstring)."""
    import torch

    from kvq.errors import ModelError
    from kvq.model import Backbone
    from kvq.text import load_tokenizer
    from kvq.text.grammar import compile_grammar
    from kvq.tools.bench.prefill import cpu_features

    cfg.check()
    try:
        compiled = compile_grammar("json_schema", cfg.schema_text())
    except (ModelError, ValueError) as exc:
        raise ConfigError(f"bench structured --schema: {exc}") from None
    torch.set_num_threads(cfg.threads)
    bb, tok = Backbone.from_gguf(cfg.model), load_tokenizer(cfg.model)
    sides: dict[str, dict[str, list[dict[str, Any]]]] = {"plain": {}, "schema": {}}
    engines = {n: _engine(bb, tok, n) for n in cfg.sequences}  # long-lived, as a coordinator's
    for n in cfg.sequences:  # warm-up: kernels, caches, the grammar vocabulary of each engine
        _decode(engines[n], tok, cfg, compiled)
    for _ in range(cfg.rounds):
        for n in cfg.sequences:
            with_schema = _decode(engines[n], tok, cfg, compiled)
            plain = _decode(engines[n], tok, cfg, None, with_schema.pop("generated"))
            sides["schema"].setdefault(str(n), []).append(with_schema)
            sides["plain"].setdefault(str(n), []).append(plain | {"generated": []})
    plain, schema = medians(sides["plain"]), medians(sides["schema"])
    return {
        "model": str(Path(cfg.model).resolve()),
        "tokens": cfg.tokens,
        "rounds": cfg.rounds,
        "threads": torch.get_num_threads(),
        "sequences": list(cfg.sequences),
        "schema": json.loads(cfg.schema_text()),
        "cpu": cpu_features(),
        "plain": plain,
        "schema_side": schema,
        "ratio": {n: round(schema[n]["tok_s"] / plain[n]["tok_s"], 3) for n in plain},
        # each schema round against the plain round right after it: robust to load drift
        "ratio_paired_median": {
            n: round(
                statistics.median(
                    a["tok_s"] / b["tok_s"]
                    for a, b in zip(sides["schema"][n], sides["plain"][n], strict=True)
                ),
                3,
            )
            for n in plain
        },
        "rounds_tok_s": {
            s: {n: [r["tok_s"] for r in rs] for n, rs in v.items()} for s, v in sides.items()
        },
    }


def _engine(bb: Any, tok: Any, n: int) -> tuple[Any, list[float]]:
    """A coordinator's `Engine` of `n` slots, and the seconds of each of its logit shapings."""
    from kvq.coordinator.engine import Engine

    engine = Engine(bb, tok, n_slots=n)
    return engine, _timed(engine, "_shaped")


def _decode(
    timed: tuple[Any, list[float]],
    tok: Any,
    cfg: StructuredBench,
    g: str | None,
    forced: list[list[int]] | None = None,
) -> dict[str, Any]:
    """As many sequences as `engine` has slots, until all are done: under grammar `g`, or
    replaying `forced` (each sequence's tokens) without one."""
    from kvq import wire

    engine, shaping = timed
    n = engine.n_slots
    params = wire.SamplingParams(temperature=0.0, grammar=g)
    admit_s = []
    for i in range(n):  # distinct prompts, so no two sequences are the same work
        ids = tok.encode(f"{PROMPT} {i}", add_bos=True)
        t0 = time.perf_counter()
        engine.admit(f"bench-{i}", ids, cfg.tokens, b"", params, forced=(forced or [[]] * n)[i])
        admit_s.append(time.perf_counter() - t0)
    shaping.clear()
    run = drain(engine)
    return {
        **run.figures(),
        "admit_ms": 1000 * statistics.median(admit_s) if g else 0.0,
        "mask_ms_per_step": 1000 * sum(shaping[1:]) / max(run.steps, 1),
        "mask_share": sum(shaping[1:]) / run.wall_s if run.wall_s > 0 else 0.0,
        "generated": run.generated,
    }


def _timed(engine: Any, method: str) -> list[float]:
    """Seconds of each call of `engine.method` from now on (this engine only)."""
    spent: list[float] = []
    inner = getattr(engine, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    setattr(engine, method, timed)
    return spent
