"""Stage grain in one process (X12): a head-only backbone and a chain of stage backbones, each
loaded from a sparse file holding only its span's bytes, give the full backbone's logits bit
for bit, for every family kvq runs, over a batch of two sequences of different lengths and
several decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf.registry import plan_stages
from kvq.model import Backbone, KVCache, SeqStep
from kvq.model.stage import load_stage, write_stage_file
from kvq.tools.synth import make_tiny
from kvq.worker.fetch import fetch_slice

FAMILIES = [
    ("qwen3moe", "", "f32"),
    ("qwen2moe", "", "q8_0"),
    ("mixtral", "", "q4_k_m"),
    ("olmoe", "", "q4_k_m"),
    ("deepseek2", "v3", "f32"),
    ("deepseek2", "v2-lite", "f32"),
    ("glm4moe", "", "f32"),
    ("gpt-oss", "", "mxfp4"),
    ("qwen35moe", "", "f32"),
    ("llama4", "", "f32"),
]


def _chain_logits(
    head: Backbone, stages: list[Backbone], caches: list[list[KVCache]], steps: list[list[int]]
) -> torch.Tensor:
    """One pass of `steps` (tokens per sequence) through the head and the stages."""
    lens = [len(t) for t in steps]
    h = head.embed_tokens([t for toks in steps for t in toks])
    for stage, cs in zip(stages, caches, strict=True):
        h = stage.run_span(h, cs, lens)
        Backbone.advance_caches(cs, lens)
    return head.head(h, lens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("arch", "variant", "quant"), FAMILIES)
def test_a_chain_of_stage_files_gives_the_full_models_logits(
    tmp_path: Path, arch: str, variant: str, quant: str
) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, arch=arch, variant=variant, layers=5, experts=8, seed=3, quant=quant)
    meta = read_meta(path)
    specs = plan_stages(meta, path, 2)
    assert [(s.layer_start, s.layer_end) for s in specs] == [(0, 2), (2, 4), (4, 5)]
    stages = []
    for spec in specs:
        blobs = fetch_slice(str(path), spec, 10.0, None)
        out = tmp_path / f"{spec.sid.replace(':', '_')}.gguf"
        sparse = write_stage_file(spec, blobs, out, meta.file_size)
        # only the header and the span's tensors were written: the rest is holes
        assert spec.nbytes < path.stat().st_size
        stages.append(load_stage(spec, sparse, "cpu", torch.float32))
    head = Backbone.from_gguf(path, span=range(0))
    full = Backbone.from_gguf(path)
    prompts = [[5, 9, 14, 2, 7], [3, 1]]
    full_caches = [full.new_cache() for _ in prompts]
    stage_caches = [[st.new_cache() for _ in prompts] for st in stages]
    inputs = prompts
    for _ in range(4):
        want = full.forward([SeqStep(t, c) for t, c in zip(inputs, full_caches, strict=True)])
        got = _chain_logits(head, stages, stage_caches, inputs)
        assert torch.equal(got, want), f"{arch}: max diff {(got - want).abs().max()}"
        inputs = [[int(t)] for t in want.argmax(-1)]


def test_a_stage_backbone_has_no_head_and_holds_only_its_span(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=4)
    meta = read_meta(path)
    spec = plan_stages(meta, path, 3)[1]
    blobs = fetch_slice(str(path), spec, 10.0, None)
    sparse = write_stage_file(spec, blobs, tmp_path / "s.gguf", meta.file_size)
    stage = load_stage(spec, sparse, "cpu", torch.float32)
    assert stage.span == range(3, 4) and set(stage.experts) == {3}
    with pytest.raises(ModelError, match="no token embedding"):
        stage.embed_tokens([1])
    with pytest.raises(ModelError, match="not a range"):
        Backbone.from_gguf(path, span=range(2, 9))
