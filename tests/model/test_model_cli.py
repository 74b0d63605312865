"""`kvq model make-tiny|inspect`, `kvq generate`, `kvq bench experts`, run in-process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

from kvq.cli import main
from kvq.cli import model as cli_model
from kvq.gguf import read_meta, slice_nbytes
from kvq.gguf.arch import TINY_ARCHS
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.model.loader import GqaWeights
from kvq.model.qstack import QMatrix
from kvq.text import load_tokenizer
from kvq.tools.synth.presets import PRESETS, Preset, plan, write_preset
from kvq.tools.synth.quants import MIXES, QUANT_NAMES
from kvq.tools.synth.tiny import TOKENIZERS, VARIANTS, TinyConfig, write_tiny


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out = _run(capsys, *argv)
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


def test_cli_choices_match_the_library() -> None:
    assert sorted(cli_model.ARCHS) == sorted(TINY_ARCHS)
    assert list(cli_model.QUANTS) == list(QUANT_NAMES)
    assert cli_model.MIXES == MIXES and cli_model.TOKENIZERS == TOKENIZERS
    assert list(cli_model.PRESETS) == list(PRESETS)
    assert cli_model.VARIANTS == VARIANTS["deepseek2"]


@pytest.mark.parametrize(
    ("arch", "quant"),
    [
        ("qwen2moe", "q4_k"),
        ("mixtral", "q5_0"),
        ("deepseek2", "q4_k"),
        ("glm4moe", "q8_0"),
        ("olmoe", "f16"),
        ("qwen35moe", "q8_0"),
    ],
)
def test_make_tiny_then_inspect(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, arch: str, quant: str
) -> None:
    path = str(tmp_path / "m.gguf")
    code, out = _run(
        capsys,
        "model",
        "make-tiny",
        path,
        "--arch",
        arch,
        "--quant",
        quant,
        "--hidden",
        "256",
        "--expert-ffn",
        "256",
        "--experts",
        "6",
        "--layers",
        "3",
    )
    assert code == 0 and "wrote" in out
    d = _json(capsys, "model", "inspect", path, "--slice-experts", "4", "--json")
    meta = read_meta(path)
    assert d["arch"] == TINY_ARCHS[arch] and (d["block_count"], d["expert_count"]) == (3, 6)
    assert (d["expert_used_count"], d["embedding_length"]) == (2, 256)
    assert d["expert_feed_forward_length"] == 256
    moe = meta.moe_layers  # deepseek2, glm4moe: after one dense layer
    assert len(moe) == (2 if arch in ("deepseek2", "glm4moe") else 3)
    n_exps = len(moe) + meta.nextn_predict_layers  # glm4moe's MTP block has experts too
    assert d["quant_types"]["ffn_down_exps"] == {quant.upper(): n_exps}
    assert d["quant_types"]["ffn_gate_inp"] == {"F32": n_exps}
    want = [(layer, e0, min(e0 + 4, 6)) for layer in moe for e0 in (0, 4)]
    assert [(s["layer"], s["expert_start"], s["expert_end"]) for s in d["slices"]] == want
    assert all(s["bytes"] == slice_nbytes(meta, *want[i]) for i, s in enumerate(d["slices"]))
    code, text = _run(capsys, "model", "inspect", path)
    assert code == 0 and "ffn_gate_exps" in text and quant.upper() in text and "slices" in text


def test_make_tiny_k_quants_fall_back_where_rows_are_not_whole_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = str(tmp_path / "x.gguf")
    code, out = _run(capsys, "model", "make-tiny", path, "--quant", "q4_k")  # hidden 64
    assert code == 0 and "(qwen3moe, q4_k, bpe tokenizer)" in out
    d = _json(capsys, "model", "inspect", path, "--json")
    assert d["quant_types"]["ffn_down_exps"] == {"Q5_0": 2}  # llama-quantize's fallback
    assert d["tokenizer_model"] == "gpt2"  # make-tiny's default: a tokenizer llama.cpp loads
    assert load_tokenizer(path).encode("Zq", add_bos=False) == [90, 113]  # no merge: bytes
    code, _ = _run(
        capsys,
        "model",
        "make-tiny",
        path,
        "--quant",
        "q4_k_m",
        "--hidden",
        "256",
        "--expert-ffn",
        "256",
        "--tokenizer",
        "bytes",
    )
    d = _json(capsys, "model", "inspect", path, "--json")
    assert d["quant_types"]["output"] == {"Q6_K": 1} and d["tokenizer_model"] == "kvq-bytes"
    assert d["quant_types"]["attn_v"] == {"Q8_0": 2}  # 8 experts: llama.cpp's Mixtral rule


def test_make_tiny_preset_usage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "p.gguf")
    code, text = _run(capsys, "model", "make-tiny", out, "--preset", "qwen3-30b-a3b", "--dry-run")
    total = sum(t.nbytes for t in plan(PRESETS["qwen3-30b-a3b"]))
    assert code == 0 and f"qwen3-30b-a3b at q4_k_m: {total:,} bytes" in text
    assert not (tmp_path / "p.gguf").exists()
    for extra in (["--hidden", "64"], ["--arch", "mixtral"], ["--tokenizer", "bytes"]):
        assert main(["model", "make-tiny", out, "--preset", "olmoe-1b-7b", *extra]) == 2
        assert "sets the arch, every dimension" in capsys.readouterr().err
    assert main(["model", "make-tiny", out, "--dry-run"]) == 2
    with pytest.raises(SystemExit):
        main(["model", "make-tiny", out, "--preset", "gpt-5"])


def test_inspect_sizes_and_memory(capsys: pytest.CaptureFixture[str], odd_path: Path) -> None:
    d = _json(capsys, "model", "inspect", str(odd_path), "--json", "--slice-experts", "4")
    meta = read_meta(odd_path)
    reader = GGUFReader(odd_path)
    assert d["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert d["expert_bytes"] == sum(s["bytes"] for s in d["slices"]) == 2 * 3 * 6 * 48 * 32 * 4
    assert d["backbone_bytes"] == d["tensor_bytes"] - d["expert_bytes"]
    m = d["memory"]
    assert (m["dtype"], m["n_slots"], m["kv_positions"]) == ("float32", 4, 512)
    kv = 4 * 512 * 2 * 2 * meta.head_count_kv * meta.head_dim * 4
    assert m["kv_cache_bytes"] == kv
    embed = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    assert m["backbone_bytes"] == d["backbone_bytes"]  # F32 file: dense size = encoded size
    assert m["coordinator_none_bytes"] == m["backbone_bytes"] + kv and embed > 0
    assert m["coordinator_all_bytes"] == m["coordinator_none_bytes"] + d["expert_bytes"]
    assert m["worker_slice_bytes_max"] == 4 * 3 * 48 * 32 * 4  # experts 0-3 of a layer
    assert m["worker_slice_bytes_min"] == 2 * 3 * 48 * 32 * 4  # experts 4-5
    assert len(m["assumptions"]) == 4
    bf = _json(
        capsys,
        "model",
        "inspect",
        str(odd_path),
        "--json",
        "--dtype",
        "bfloat16",
        "--n-slots",
        "2",
        "--kv-positions",
        "100",
    )["memory"]
    assert bf["kv_cache_bytes"] == 2 * 100 * 2 * 2 * meta.head_count_kv * meta.head_dim * 2
    assert bf["backbone_bytes"] == (m["backbone_bytes"] - embed) // 2 + embed
    code, text = _run(capsys, "model", "inspect", str(odd_path))
    assert code == 0 and "KVQ_COORDINATOR_EXPERTS=none" in text and "assumptions:" in text
    assert f"{m['coordinator_all_bytes']:,} B" in text


def test_inspect_quantized_backbone_counts_what_the_loader_keeps_encoded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The estimate is what `Backbone` really holds: each weight matrix the loader kept
    encoded (`QMatrix`) or `QRows` counts at its encoded, mapped size; every other tensor
    dense in the compute dtype."""
    path = tmp_path / "q.gguf"
    write_preset(
        path,
        Preset("s", TinyConfig(2, 4, 2, 256, 256, 4, 2, 64, vocab=600), 64, 1e6, 1e-6),
        "q4_k_m",
    )
    m = _json(capsys, "model", "inspect", str(path), "--json")["memory"]
    reader = GGUFReader(path)
    size = {t.name: int(t.n_bytes) for t in reader.tensors}
    bb = Backbone.from_gguf(path)
    encoded = (
        {"token_embd.weight"}
        | {
            f"blk.{i}.{name}.weight"
            for i, lw in enumerate(bb.layers)
            if isinstance(lw.attn, GqaWeights)
            for name, w in (
                ("attn_q", lw.attn.wq),
                ("attn_k", lw.attn.wk),
                ("attn_v", lw.attn.wv),
                ("attn_output", lw.attn.wo),
            )
            if isinstance(w, QMatrix)
        }
        | (
            {"output.weight"}
            if isinstance(bb.output, QMatrix) and "output.weight" in size
            else set()
        )
    )
    assert len(encoded) > 2, "a Q4_K_M backbone keeps its attention matrices encoded"
    dense = sum(
        int(t.n_elements) * 4
        for t in reader.tensors
        if "_exps." not in t.name and t.name not in encoded
    )
    assert m["backbone_mapped_bytes"] == sum(size[n] for n in encoded)
    assert m["backbone_dense_bytes"] == dense
    assert m["backbone_bytes"] == m["backbone_dense_bytes"] + m["backbone_mapped_bytes"]
    bf = _json(capsys, "model", "inspect", str(path), "--json", "--dtype", "bfloat16")["memory"]
    assert bf["backbone_mapped_bytes"] == size["token_embd.weight"], "no bf16 kernel: dense"


def test_generate_json_matches_the_library(
    capsys: pytest.CaptureFixture[str], odd_path: Path, odd_backbone: Backbone
) -> None:
    tok = load_tokenizer(odd_path)
    d = _json(
        capsys,
        "generate",
        "--model",
        str(odd_path),
        "--prompt",
        "hi there",
        "--max-tokens",
        "7",
        "--json",
    )
    want = generate(odd_backbone, tok.encode("hi there"), 7)
    assert d["token_ids"] == want and d["text"] == tok.decode(want)
    assert d["prompt_ids"] == tok.encode("hi there")
    d2 = _json(
        capsys,
        "generate",
        "--model",
        str(odd_path),
        "--prompt-ids",
        "256,104,105",
        "--max-tokens",
        "3",
        "--json",
    )
    assert d2["token_ids"] == generate(odd_backbone, [256, 104, 105], 3)


def test_generate_sampling_is_seeded(capsys: pytest.CaptureFixture[str], odd_path: Path) -> None:
    args = [
        "generate",
        "--model",
        str(odd_path),
        "--prompt",
        "x",
        "--max-tokens",
        "12",
        "--temperature",
        "1.5",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--json",
    ]
    a = _json(capsys, *args, "--seed", "1")["token_ids"]
    assert a == _json(capsys, *args, "--seed", "1")["token_ids"]
    assert a != _json(capsys, *args, "--seed", "2")["token_ids"]


@pytest.mark.parametrize(
    "argv",
    [["--prompt-ids", "1,x"], ["--prompt-ids", "-1"], ["--prompt", "a", "--prompt-ids", "1"], []],
)
def test_generate_usage_errors_exit_2(odd_path: Path, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(odd_path), *argv])
    assert exc.value.code == 2


def test_generate_bad_sampling_exits_1(capsys: pytest.CaptureFixture[str], odd_path: Path) -> None:
    assert main(["generate", "--model", str(odd_path), "--prompt", "a", "--top-p", "0"]) == 1
    assert "top_p 0.0 must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_generate_prints_real_text_with_the_files_tokenizer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import tokenizer_fixtures as fx

    trained = fx.train_byte_level()
    path = tmp_path / "bpe-model.gguf"
    cfg = TinyConfig(2, 4, 2, 32, 32, 4, 2, 8, vocab=trained.get_vocab_size())
    write_tiny(path, cfg, seed=4, tokenizer=lambda w: fx.add_byte_level_vocab(w, trained))
    d = _json(
        capsys,
        "generate",
        "--model",
        str(path),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "10",
        "--json",
    )
    assert d["prompt_ids"] == trained.encode("The quick brown fox").ids
    assert d["text"] == trained.decode(d["token_ids"]) and len(d["text"]) >= 10
    code, out = _run(
        capsys,
        "generate",
        "--model",
        str(path),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "10",
    )
    assert code == 0 and out == d["text"] + "\n"  # streamed as it was generated


def test_bench_experts_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(
        capsys,
        "bench",
        "experts",
        "--json",
        "--hidden",
        "64",
        "--expert-ffn",
        "64",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--repeat",
        "1",
        "--quants",
        "q8_0,q4_k",
    )
    assert set(d["ratio_vs_matmul"]) == {"1", "8", "64"}
    for row in d["expert_ffn"]:
        assert row["ffn_gflops"] > 0 and row["matmul_gflops"] > 0 and row["ratio_vs_matmul"] > 0
    q8, q4k = d["slice_load"]
    assert (
        q8["quant"] == "q8_0" and q8["mb_per_s"] > 0 and q8["bytes"] == 3 * 2 * 64 * 64 // 32 * 34
    )
    assert q4k == {"quant": "q4_k", "skipped": "hidden 64 / expert_ffn 64 not multiples of 256"}
    assert main(["bench", "experts", "--experts", "2", "--experts-used", "3"]) == 2
