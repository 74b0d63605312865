"""`kvq bench structured`: both sides decode the same tokens (the plain side replays the schema
side's), so the ratio compares the mask alone; a bad schema is a ConfigError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvq.errors import ConfigError
from kvq.tools.bench.structured import StructuredBench, run_structured_bench
from kvq.tools.synth import make_tiny

pytest.importorskip("llguidance")


def test_both_sides_decode_the_same_tokens(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=2, experts=8, experts_used=2, tokenizer="bpe")
    out = run_structured_bench(StructuredBench(str(model), sequences=(1, 3), tokens=6, rounds=1))
    for n in ("1", "3"):
        plain, schema = out["plain"][n], out["schema_side"][n]
        assert plain["tokens"] == schema["tokens"] == int(n) * 5
        assert schema["mask_ms_per_step"] > 0 and schema["admit_ms"] > 0
        assert out["ratio"][n] > 0 and 0 < schema["mask_share"] < 1
    assert out["schema"]["properties"]["days"]["minItems"] == 6
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": 7}))
    with pytest.raises(ConfigError, match="--schema"):
        run_structured_bench(StructuredBench(str(model), schema=str(bad)))
