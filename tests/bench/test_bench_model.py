"""`kvq bench model`: one real kvq round on a tiny file through the CLI, and the llama.cpp
branches (missing, failed load, ratios) with the subprocess stubbed. llama_cpp is optional."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvq.cli import main
from kvq.tools.bench import model as bench_model
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.timeout(60)

KVQ_FIGURES = (
    "load_s",
    "peak_rss_mb",
    "anon_rss_mb_load",
    "anon_rss_mb_decode",
    "decode_tok_s",
    "aggregate_tok_s",
    "aggregate_gain",
    "prompt_tokens",
    "experts_per_layer_1",
    "experts_per_layer_batch",
    "expert_ms_per_layer_1",
    "expert_ms_per_layer_batch",
    "expert_share_1",
    "expert_share_batch",
    "prefill_tok_s",
    "ttft_s",
    "ttft_first_s",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_model") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, hidden=64, expert_ffn=64)
    return path


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _fake_round(engine: str, decode_tok_s: float) -> dict[str, Any]:
    r: dict[str, Any] = {
        "load_s": 2.0,
        "peak_rss_mb": 100.0,
        "anon_rss_mb_load": 50.0,
        "anon_rss_mb_decode": 60.0,
        "prompt_tokens": 9,
        "decode_tokens": 4,
        "decode_tok_s": decode_tok_s,
        "prefill_tokens": 512,
        "prefill_tok_s": 10 * decode_tok_s,
        "ttft_s": 51.2 / decode_tok_s,
        "ttft_first_s": 60.0 / decode_tok_s,
    }
    if engine == "kvq":
        r |= {"aggregate_tok_s": 3 * decode_tok_s, "hit_rate": None, "bank_note": "stub"}
    # llama.cpp refuses the 64-sequence context: null, with its note
    r["aggregates"] = {"8": 3 * decode_tok_s, "64": 5 * decode_tok_s if engine == "kvq" else None}
    return r


@pytest.mark.slow
def test_kvq_round_reports_every_figure(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    r = _json(
        capsys,
        "bench",
        "model",
        "--model",
        str(tiny),
        "--no-llama",
        "--tokens",
        "4",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--prefill-tokens",
        "40",
        "--json",
    )
    assert r["file_mb"] > 0 and r["threads"] == 1 and r["rounds"] == 1
    kq = r["kvq"]
    assert r["prefill_tokens"] == 40 and kq["prefill_tokens"] == 40
    assert kq["prefill_tok_s"] == pytest.approx(40 / kq["ttft_s"])
    assert set(kq["paths"]) == {"activations", "int8_isa", "many_rows"}
    assert kq["paths"]["activations"] == kq["activations"]
    assert isinstance(r["cpu"], dict)
    for key in KVQ_FIGURES:
        assert isinstance(kq[key], int | float) and kq[key] > 0, key
    assert kq["decode_tokens"] == 4
    assert kq["aggregate_sequences"] == 8 and kq["aggregate_tokens"] > 0
    assert r["batch"] == 8 and r["sequences"] == [8]
    assert kq["aggregates"] == {"8": kq["aggregate_tok_s"]}
    assert kq["peak_rss_mb"] >= kq["anon_rss_mb_load"]
    # top-2 of 8 experts: one token routes to exactly 2 a layer, 8 sequences to 2..8
    assert kq["experts_per_layer_1"] == 2.0
    assert 2.0 <= kq["experts_per_layer_batch"] <= 8.0
    assert kq["expert_share_1"] < 1.0 and kq["expert_share_batch"] < 1.0
    assert kq["aggregate_gain"] == pytest.approx(kq["aggregate_tok_s"] / kq["decode_tok_s"])
    assert len(kq["per_round"]) == 1
    hr = kq["hit_rate"]
    assert hr is None or (hr["routed"] > 0 and hr["hot"] + hr["cold"] == pytest.approx(1.0))
    assert "llama" not in r and "ratio" not in r
    assert "--no-llama" in r["llama_note"]


def test_missing_llama_cpp_gives_a_note_and_no_llama_round(
    monkeypatch: pytest.MonkeyPatch, tiny: Path
) -> None:
    spawned: list[str] = []

    def spawn(engine: str, cfg: bench_model.ModelBench) -> dict[str, Any]:
        spawned.append(engine)
        return _fake_round(engine, 10.0)

    def read_through(path: str) -> float:
        spawned.append("read")
        return 0.5

    monkeypatch.setattr(bench_model, "_spawn", spawn)
    monkeypatch.setattr(bench_model, "read_through", read_through)
    monkeypatch.setattr(bench_model, "llama_available", lambda: False)
    r = bench_model.run_model_bench(bench_model.ModelBench(str(tiny), rounds=2))
    assert spawned == ["read", "kvq", "read", "kvq"]  # each kvq round finds the file cached
    assert r["page_cache_warm_s"] == 0.5 and r["page_cache_rewarm_s"] == [0.5]
    assert "llama" not in r and "pip install" in r["llama_note"]


def test_llama_load_failure_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, tiny: Path
) -> None:
    def spawn(engine: str, cfg: bench_model.ModelBench) -> dict[str, Any]:
        if engine == "llama":
            return {"error": "llama.cpp could not load the file: unknown tokenizer 'kvq-bytes'"}
        return _fake_round(engine, 10.0)

    monkeypatch.setattr(bench_model, "_spawn", spawn)
    monkeypatch.setattr(bench_model, "llama_available", lambda: True)
    r = bench_model.run_model_bench(bench_model.ModelBench(str(tiny), rounds=1))
    assert r["llama"] == {
        "error": "llama.cpp could not load the file: unknown tokenizer 'kvq-bytes'"
    }
    assert r["kvq"]["decode_tok_s"] == 10.0 and "ratio" not in r


def test_rounds_alternate_and_ratios_are_kvq_over_llama_medians(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny: Path
) -> None:
    order: list[str] = []
    rates = iter([10.0, 40.0, 30.0, 20.0, 20.0, 80.0])  # kvq, llama, kvq, llama, ...

    def spawn(engine: str, cfg: bench_model.ModelBench) -> dict[str, Any]:
        order.append(engine)
        return _fake_round(engine, next(rates))

    monkeypatch.setattr(bench_model, "_spawn", spawn)
    monkeypatch.setattr(bench_model, "llama_available", lambda: True)
    r = _json(capsys, "bench", "model", "--model", str(tiny), "--rounds", "3", "--json")
    assert order == ["kvq", "llama"] * 3
    assert r["kvq"]["decode_tok_s"] == 20.0 and r["llama"]["decode_tok_s"] == 40.0
    assert r["ratio"]["decode_tok_s"] == pytest.approx(0.5)
    assert r["kvq"]["prefill_tok_s"] == 200.0 and r["llama"]["prefill_tok_s"] == 400.0
    assert r["ratio"]["prefill_tok_s"] == pytest.approx(0.5)
    assert r["ratio"]["ttft_s"] == pytest.approx(2.0)  # a time: kvq / llama, lower is better
    assert r["ratio"]["load_s"] == pytest.approx(1.0)
    assert r["kvq"]["prompt_tokens"] == 9 and isinstance(r["kvq"]["prompt_tokens"], int)
    assert r["ratio"]["aggregate_tok_s"] is None  # the stub's llama rounds have none
    # per count: medians over rounds, and kvq / llama where both have a figure
    assert r["kvq"]["aggregates"] == {"8": 60.0, "64": 100.0}
    assert r["llama"]["aggregates"] == {"8": 120.0, "64": None}
    assert r["ratio"]["aggregates"] == {"8": pytest.approx(0.5), "64": None}
    assert [p["aggregates"]["8"] for p in r["kvq"]["per_round"]] == [30.0, 90.0, 60.0]
    rates = iter([10.0, 40.0])
    assert main(["bench", "model", "--model", str(tiny), "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert "decode_tok_s" in text and "kvq/llama" in text and "aggregate @ 64" in text
    assert "prefill_tok_s" in text and "ttft_s" in text


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    assert main(["bench", "model", "--model", str(tiny), "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["bench", "model", "--model", str(tiny), "--sequences", "0"]) == 2
    assert "--sequences" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # argparse's own exit
        main(["bench", "model", "--model", str(tiny), "--sequences", "8,x"])
    assert bad.value.code == 2 and "--sequences" in capsys.readouterr().err
    assert main(["bench", "model", "--model", str(tiny), "--sequences", "8,8"]) == 2
    assert "each count once" in capsys.readouterr().err
    assert main(["bench", "model", "--model", str(tiny.with_suffix(".nope"))]) == 2


def test_stderr_hint_keeps_the_reason_of_a_failed_load() -> None:
    stderr = (
        "llama_model_loader: loaded meta data\nllama_model_load: error loading model: "
        "unknown tokenizer: 'kvq-bytes'\nllama_load_model_from_file: failed to load model\n"
    )
    hint = bench_model._stderr_hint(stderr)
    assert "unknown tokenizer" in hint and "loaded meta data" not in hint


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp not built")
@pytest.mark.slow
def test_llama_round_runs_or_reports_why(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    r = _json(
        capsys,
        "bench",
        "model",
        "--model",
        str(tiny),
        "--tokens",
        "4",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--prefill-tokens",
        "40",
        "--sequences",
        "2,3",
        "--json",
    )
    ll = r["llama"]
    assert ll.get("error") or ll["decode_tok_s"] > 0
    assert set(r["kvq"]["aggregates"]) == {"2", "3"} and r["kvq"]["aggregate_sequences"] == 2
    assert all(v > 0 for v in r["kvq"]["aggregates"].values())
    if not ll.get("error"):  # both engines prefill the same number of tokens in the round
        assert ll["prefill_tokens"] == r["kvq"]["prefill_tokens"] == 40
        assert ll["prefill_tok_s"] == pytest.approx(40 / ll["ttft_s"])
        assert ll["paths"]["system_info"]
        assert r["ratio"]["prefill_tok_s"] > 0


def test_prefill_prompts_have_exactly_n_tokens_and_differ() -> None:
    from kvq.tools.bench.prefill import prompt_ids

    def encode(text: str) -> list[int]:  # BOS, then one id per word
        return [1] + [len(w) for w in text.split()]

    a, b = (prompt_ids(encode, "the quick brown fox", 512, salt) for salt in (0, 1))
    assert len(a) == len(b) == 512 and a[0] == b[0] == 1
    assert prompt_ids(encode, "x", 3, 0) == [1, 1, 5]  # "x (0.0)": cut at n
    assert prompt_ids(lambda t: [1] + [7] * (len(t) // 40), "word", 100, 0)[1:] == [7] * 99


def test_cpu_features_name_the_isa_extensions(tmp_path: Path) -> None:
    from kvq.tools.bench.prefill import cpu_features

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f "
        "avx512bw avx512_vnni avx512_bf16\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n"
    )
    assert cpu_features(info) == {
        "model": "AMD EPYC",
        "flags": ["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"],
    }
    assert cpu_features(tmp_path / "none") == {}


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp not built")
def test_llama_batch_decodes_each_sequence_as_alone(tmp_path: Path) -> None:
    """The multi-sequence batch gives each sequence the greedy tokens llama.cpp's own
    one-sequence `generate` gives it (so the aggregate rate counts real decoding)."""
    from llama_cpp import Llama

    from kvq.tools.bench.llama_batch import decode_together

    path = tmp_path / "bpe.gguf"
    make_tiny(
        path,
        layers=2,
        experts=8,
        experts_used=2,
        hidden=256,
        expert_ffn=256,
        tokenizer="bpe",
        quant="q4_k",
    )
    llm = Llama(model_path=str(path), n_threads=1, n_ctx=128, verbose=False)
    prompts = [llm.tokenize(f"hello world {i}".encode(), add_bos=True) for i in range(4)]
    out, rate = decode_together(llm, prompts, 6, threads=1)
    assert rate > 0
    for prompt, together in zip(prompts, out, strict=True):
        alone = []
        for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            alone.append(t)
            if len(alone) == 6:
                break
        assert together == alone


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp not built")
def test_llama_round_gives_each_count_or_a_note(tmp_path: Path) -> None:
    """Each count of `sequences` gets its own multi-sequence context; one llama.cpp refuses
    (more sequences than its LLAMA_MAX_SEQ, 256) is null with the reason, the others stand."""
    path = tmp_path / "bpe.gguf"
    make_tiny(
        path,
        layers=2,
        experts=8,
        experts_used=2,
        hidden=64,
        expert_ffn=64,
        tokenizer="bpe",
        quant="q4_k",
    )
    cfg = bench_model.ModelBench(
        str(path), threads=1, tokens=3, sequences=(2, 4, 300), prefill_tokens=0
    )
    r = bench_model.child_llama(cfg)
    assert r["aggregates"]["2"] > 0 and r["aggregates"]["4"] > 0
    assert r["aggregate_tok_s"] == r["aggregates"]["2"] and r["aggregate_sequences"] == 2
    assert r["aggregates"]["300"] is None and "300 sequences" in r["aggregate_notes"]["300"]
    assert set(r["aggregate_notes"]) == {"300"} and r["aggregate_note"] == ""
