"""`kvq bench speculative`: both sides give the same tokens, the draft side reports its
acceptance and tokens per pass, and a bad value is a ConfigError naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.speculative import (
    SpeculativeBench,
    load_prompts,
    prompt_of,
    run_speculative_bench,
)
from kvq.tools.synth import make_tiny


def test_both_sides_give_the_same_tokens(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=2, experts=8, experts_used=2, hidden=64, expert_ffn=64, seed=4)
    out = run_speculative_bench(SpeculativeBench(str(model), sequences=(1, 3), tokens=12, rounds=1))
    assert out["same"] is True
    for n in ("1", "3"):
        plain, drafts = out["plain"][n], out["drafts"][n]
        assert plain["tokens"] == drafts["tokens"] > 0
        assert plain["tokens_per_pass"] == 1.0 and plain["acceptance"] == 0.0
        assert drafts["tokens_per_pass"] >= 1.0 and 0 <= drafts["acceptance"] <= 1
        assert drafts["steps"] <= plain["steps"] and out["speedup"][n] > 0
    with pytest.raises(ConfigError, match="--draft-tokens"):
        run_speculative_bench(SpeculativeBench(str(model), draft_tokens=0))


def test_prompts_from_a_file(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8, experts_used=2, hidden=64, expert_ffn=64, seed=5)
    good, bad = tmp_path / "p.json", tmp_path / "bad.json"
    good.write_text('["def f(x):\\n    return x\\n", "import os\\n"]')
    bad.write_text('{"prompt": "x"}')
    prompts = load_prompts(str(good))
    cfg = SpeculativeBench(str(model), sequences=(3,), tokens=4, rounds=1, prompts=prompts)
    assert [prompt_of(cfg, i) for i in range(3)] == [prompts[0], prompts[1], prompts[0]]
    out = run_speculative_bench(cfg)
    assert out["same"] is True and out["prompts"] == 2
    with pytest.raises(ConfigError, match="--prompts"):
        load_prompts(str(bad))
    with pytest.raises(ConfigError, match="--prompts"):
        run_speculative_bench(SpeculativeBench(str(model), prompts=("",)))
