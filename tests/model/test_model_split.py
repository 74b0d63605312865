"""`kvq model split --backbone`: a GGUF without the routed experts (issue 33 item 3)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvq.cli import main
from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.gguf import reader as gio
from kvq.gguf.registry import header_sha256
from kvq.gguf.split import backbone_source, is_routed, write_backbone
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny


@pytest.fixture(
    scope="module",
    params=[
        ("qwen2moe", "q4_k"),
        ("qwen3moe", "f32"),
        ("gpt-oss", "mxfp4"),
        ("deepseek2", "f32"),
        ("llama4", "q8_0"),
    ],
)
def full(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, quant = request.param
    path = tmp_path_factory.mktemp("split") / f"{arch}-{quant}.gguf"
    extra = {"shared_expert_ffn": 256} if arch == "qwen2moe" else {}
    make_tiny(
        path,
        arch=arch,
        quant=quant,
        layers=2,
        experts=8,
        experts_used=2,
        hidden=256,
        expert_ffn=256,
        seed=5,
        **extra,
    )
    return path


def test_split_keeps_every_non_routed_tensor_byte_for_byte(full: Path, tmp_path: Path) -> None:
    out = tmp_path / "backbone.gguf"
    r = write_backbone(full, out)
    src, bb = gio.open_reader(full), gio.open_reader(out)
    src_t, bb_t = gio.tensor_map(src), gio.tensor_map(bb)
    routed = {n for n in src_t if n.endswith(("_exps.weight", "_exps.bias"))}
    assert routed and set(r.dropped) == routed
    assert set(bb_t) == set(src_t) - routed, "every other tensor is kept"
    assert any("shexp" in n for n in bb_t) == any("shexp" in n for n in src_t)
    assert {
        "token_embd.weight",
        "output_norm.weight",
        "blk.1.ffn_gate_inp.weight",
        "blk.1.attn_norm.weight",
    } <= set(bb_t)
    for name, t in bb_t.items():
        s = src_t[name]
        assert (t.tensor_type, list(t.shape)) == (s.tensor_type, list(s.shape)), name
        assert bytes(t.data.reshape(-1).view("u1")) == bytes(s.data.reshape(-1).view("u1")), name
    dropped = sum(int(src_t[n].n_bytes) for n in routed)
    assert r.dropped_bytes == dropped
    assert r.backbone_bytes == out.stat().st_size < r.source_bytes - dropped + 64 * 1024
    for key, f in src.fields.items():  # every metadata key, with its value
        if not key.startswith("GGUF."):
            assert bb.get_field(key) is not None, key
            assert bb.get_field(key).contents() == f.contents(), key  # type: ignore[union-attr]
    source = backbone_source(out)
    assert source is not None and backbone_source(full) is None
    assert source.size == full.stat().st_size
    assert source.header_sha256 == header_sha256(full)
    assert source.sha256 == hashlib.sha256(full.read_bytes()).hexdigest()


def test_backbone_loader_runs_the_backbone_and_refuses_experts(full: Path, tmp_path: Path) -> None:
    out = tmp_path / "backbone.gguf"
    write_backbone(full, out)
    meta, whole = read_meta(out), read_meta(full)
    assert not meta.holds_experts and whole.holds_experts
    assert meta.expert_feed_forward_length == whole.expert_feed_forward_length
    bb, ref = Backbone.from_gguf(out), Backbone.from_gguf(full)
    assert bb.experts == {}
    assert load_tokenizer(out).encode("split me") == load_tokenizer(full).encode("split me")
    with pytest.raises(ModelError, match="backbone file .* only workers compute"):
        generate(bb, [1, 2, 3], 2)
    # with the full file's experts plugged in, the backbone file generates the same tokens
    prompt = load_tokenizer(full).encode("the same tokens")
    assert generate(bb, prompt, 6, moe=ref.local_moe) == generate(ref, prompt, 6)
    cache_a, cache_b = bb.new_cache(), ref.new_cache()
    from kvq.model import SeqStep

    la = bb.forward([SeqStep(prompt, cache_a)], moe=ref.local_moe)
    lb = ref.forward([SeqStep(prompt, cache_b)])
    assert torch.equal(la, lb)


def test_split_refuses_a_backbone_file_and_its_own_path(full: Path, tmp_path: Path) -> None:
    out = tmp_path / "backbone.gguf"
    write_backbone(full, out)
    with pytest.raises(ModelError, match="backbone file already"):
        write_backbone(out, tmp_path / "again.gguf")
    with pytest.raises(ModelError, match="overwrite"):
        write_backbone(full, full)


def test_is_routed_names() -> None:
    assert is_routed("blk.3.ffn_down_exps.weight") and is_routed("blk.0.ffn_gate_exps.bias")
    assert not is_routed("blk.3.ffn_down_shexp.weight")
    assert not is_routed("blk.3.ffn_gate_inp.weight") and not is_routed("token_embd.weight")


def test_cli_split_json(full: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.gguf"
    assert main(["model", "split", str(full), "--backbone", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backbone_bytes"] == out.stat().st_size
    assert d["source_bytes"] == full.stat().st_size
    assert d["dropped_bytes"] + d["backbone_bytes"] < d["source_bytes"] + 64 * 1024


def test_a_backbone_file_cannot_be_registered_and_inspects_without_slices(
    full: Path, tmp_path: Path
) -> None:
    from kvq.errors import ConfigError
    from kvq.gguf.describe import describe_model
    from kvq.gguf.registry import plan_model

    out = tmp_path / "backbone.gguf"
    write_backbone(full, out)
    with pytest.raises(ConfigError, match="register the full file"):
        plan_model("m", out, 1, 4)
    d = describe_model(out)
    assert d["slices"] == [] and d["expert_bytes"] == 0
    assert d["routed_experts"].startswith("absent")
    assert describe_model(full)["routed_experts"] == "present"


def test_the_monitor_refuses_a_backbone_file_at_once(
    full: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "backbone.gguf"
    write_backbone(full, out)
    monkeypatch.setenv("KVQ_REDIS_URL", "redis://127.0.0.1:1/0")  # refused before Redis is used
    assert main(["monitor", "--model", f"m={out}"]) == 2
    assert "register the full file" in capsys.readouterr().err
