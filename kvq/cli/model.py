"""Model commands: `kvq model make-tiny|inspect|split` (list, rm, pull: `registry`),
`kvq generate`, `kvq bench experts`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvq.cli import registry
from kvq.cli.common import EXIT_OK, EXIT_USAGE
from kvq.config import Settings

Subparsers = Any  # argparse's _SubParsersAction is private
# literal copies of kvq.gguf.arch.TINY_ARCHS, kvq.tools.synth.quants.QUANT_NAMES / MIXES,
# kvq.tools.synth.presets.PRESETS and kvq.tools.synth.tiny.TOKENIZERS (a test keeps them
# equal): importing those here would load numpy and gguf for every `kvq` command, even `--help`
ARCHS = (
    "deepseek2",
    "glm4moe",
    "gpt-oss",
    "llama4",
    "mixtral",
    "olmoe",
    "qwen2moe",
    "qwen3moe",
    "qwen35moe",
)
VARIANTS = ("v3", "v2-lite", "kv-b")  # kvq.tools.synth.tiny.VARIANTS (deepseek2's)
QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
MIXES = ("q4_k_m", "mxfp4")
PRESETS = ("small", "olmoe-1b-7b", "deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-20b")
TOKENIZERS = ("bytes", "bpe")
_TINY_INTS = (
    ("layers", 2),
    ("experts", 8),
    ("experts-used", 2),
    ("hidden", 64),
    ("expert-ffn", 64),
    ("heads", 4),
    ("kv-heads", 2),
    ("head-dim", 16),
    ("shared-expert-ffn", 0),
)
_GIB = 1 << 30


def cmd_make_tiny(args: argparse.Namespace, settings: Settings) -> int:
    given = {
        n.replace("-", "_") for n, _ in _TINY_INTS if getattr(args, n.replace("-", "_")) is not None
    }
    if args.preset is not None:
        if given or args.arch is not None or args.tokenizer not in (None, "bpe"):
            flags = ", ".join(sorted(f"--{n.replace('_', '-')}" for n in given))
            print(
                f"kvq: --preset {args.preset} sets the arch, every dimension and the bpe "
                f"tokenizer; drop {flags or '--arch/--tokenizer'}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        return _write_preset(args)
    if args.dry_run:
        print("kvq: --dry-run needs --preset", file=sys.stderr)
        return EXIT_USAGE
    from kvq.tools.synth import make_tiny

    dims: dict[str, Any] = {n.replace("-", "_"): default for n, default in _TINY_INTS}
    dims.update({n: getattr(args, n) for n in given})
    arch, quant, tok = args.arch or "qwen3moe", args.quant or "f32", args.tokenizer or "bpe"
    if args.variant and arch != "deepseek2":
        print(f"kvq: --variant is deepseek2's; --arch {arch} has none", file=sys.stderr)
        return EXIT_USAGE
    variant = args.variant or ""
    make_tiny(
        args.out, arch=arch, quant=quant, tokenizer=tok, seed=args.seed, variant=variant, **dims
    )
    print(f"wrote {args.out} ({arch}{' ' + variant if variant else ''}, {quant}, {tok} tokenizer)")
    return EXIT_OK


def _write_preset(args: argparse.Namespace) -> int:
    import time

    from kvq.tools.synth.presets import plan, preset_named, write_preset

    preset = preset_named(args.preset)
    quant = args.quant or preset.quant
    total = sum(t.nbytes for t in plan(preset, quant))
    if args.dry_run:
        print(f"{args.preset} at {quant}: {total:,} bytes of tensors ({total / _GIB:.2f} GiB)")
        return EXIT_OK
    start = time.monotonic()
    write_preset(args.out, preset, quant, args.seed)
    print(
        f"wrote {args.out} ({args.preset}, {quant}, {total / _GIB:.2f} GiB of tensors, "
        f"{time.monotonic() - start:.1f} s)"
    )
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.gguf.describe import MemoryAssumptions, describe_model
    from kvq.gguf.remote import check_source, header_copy, is_http

    mem = MemoryAssumptions(args.dtype, args.n_slots or settings.n_slots, args.kv_positions)
    experts = args.slice_experts or settings.slice_experts
    if is_http(args.file):  # its header over Range requests, into a sparse local copy
        with header_copy(args.file) as local:
            d = describe_model(local, experts, mem)
        d["path"] = args.file
    else:
        d = describe_model(check_source(args.file, "kvq model inspect FILE"), experts, mem)
    if args.json:
        print(json.dumps(d))
        return EXIT_OK
    skip = {"quant_types", "slices", "path", "memory"}
    print(d["path"])
    for key, value in d.items():
        if key not in skip:
            print(f"  {key:<36} {value}")
    print("quant types (tensor kind: type x count)")
    for kind, types in d["quant_types"].items():
        print(f"  {kind:<36} " + ", ".join(f"{t} x{n}" for t, n in types.items()))
    rows = d["slices"]
    print(f"slices ({len(rows)} of up to {d['slice_experts']} experts)")
    print(f"  {'layer':>5} {'experts':>11} {'bytes':>14}")
    for r in rows[:64]:
        span = f"{r['expert_start']}-{r['expert_end'] - 1}"
        print(f"  {r['layer']:>5} {span:>11} {r['bytes']:>14,}")
    if len(rows) > 64:
        print(f"  ... {len(rows) - 64} more (--json lists them all)")
    _print_memory(d["memory"])
    return EXIT_OK


def _print_memory(m: dict[str, Any]) -> None:
    print(f"memory ({m['dtype']}, {m['n_slots']} sequences x {m['kv_positions']} positions)")
    for key, label in (
        ("backbone_bytes", "backbone"),
        ("backbone_dense_bytes", "  dense (anonymous memory)"),
        ("backbone_mapped_bytes", "  encoded, mapped (page cache)"),
        ("kv_cache_bytes", "KV cache"),
        ("coordinator_all_bytes", "coordinator, KVQ_COORDINATOR_EXPERTS=all"),
        ("coordinator_none_bytes", "coordinator, KVQ_COORDINATOR_EXPERTS=none"),
        ("worker_slice_bytes_max", "worker, largest slice"),
        ("worker_slice_bytes_min", "worker, smallest slice"),
    ):
        print(f"  {label:<44} {m[key]:>16,} B {m[key] / _GIB:>9.3f} GiB")
    print("  assumptions:")
    for line in m["assumptions"]:
        print(f"  - {line}")


def cmd_split(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.gguf.split import write_backbone

    r = write_backbone(args.file, args.backbone)
    if args.json:
        print(
            json.dumps(
                {
                    "out": r.out,
                    "kept": list(r.kept),
                    "dropped": list(r.dropped),
                    "source_bytes": r.source_bytes,
                    "backbone_bytes": r.backbone_bytes,
                    "dropped_bytes": r.dropped_bytes,
                    "source_sha256": r.source.sha256,
                    "source_header_sha256": r.source.header_sha256,
                }
            )
        )
        return EXIT_OK
    print(
        f"wrote {r.out}: {len(r.kept)} tensors, {r.backbone_bytes:,} bytes "
        f"({r.backbone_bytes / r.source_bytes:.1%} of {r.source_bytes:,}); left out "
        f"{len(r.dropped)} routed expert tensors, {r.dropped_bytes:,} bytes"
    )
    print(
        f"  source sha256 {r.source.sha256} (workers fetch the experts from the registered "
        "source: register the full file with the monitor)"
    )
    return EXIT_OK


def cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.device import pick_device
    from kvq.model import Backbone
    from kvq.model.generate import Sampling, generate
    from kvq.text import load_tokenizer

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()  # before the (slow) model load
    tok = load_tokenizer(args.model)
    bb = Backbone.from_gguf(args.model, device=pick_device(args.device or settings.device))
    prompt = args.prompt_ids if args.prompt_ids is not None else tok.encode(args.prompt)
    stream = _TextStream(tok) if not args.json else None
    ids = generate(
        bb,
        prompt,
        args.max_tokens,
        sampling=sampling,
        on_token=stream.push if stream is not None else None,
        chunk=settings.prefill_chunk,
        draft_tokens=settings.draft_tokens if settings.speculative == "ngram" else 0,
    )
    text = tok.decode(ids)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "token_ids": ids, "text": text}))
    else:
        print(text[len(stream.shown) :] if stream is not None else "", flush=True)
    return EXIT_OK


class _TextStream:
    """Prints generated text as it grows, holding back a trailing partial UTF-8 character."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.ids, self.shown = tok, list[int](), ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text


def cmd_bench_experts(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.device import pick_device
    from kvq.tools.bench.experts import ExpertsBench, run_experts_bench

    cfg = ExpertsBench(
        hidden=args.hidden,
        expert_ffn=args.expert_ffn,
        experts=args.experts,
        experts_used=args.experts_used,
        batches=tuple(args.batches),
        repeat=args.repeat,
        quants=args.quants,
        device=str(pick_device(args.device or settings.device)),
    )
    r = run_experts_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    print(f"expert FFN on {r['device']} {r['dtype']}, {r['threads']} threads, {r['shape']}")
    for row in r["expert_ffn"]:
        print(
            f"  batch {row['batch']:>4}  ffn {row['ffn_gflops']:8.1f} GFLOP/s  matmul "
            f"{row['matmul_gflops']:8.1f} GFLOP/s  ratio {row['ratio_vs_matmul']:.2f}"
        )
    print("slice load (dequantize to float32)")
    for row in r["slice_load"]:
        if "skipped" in row:
            print(f"  {row['quant']:<5} skipped: {row['skipped']}")
        else:
            print(f"  {row['quant']:<5} {row['mb_per_s']:10.1f} MB/s  ({row['bytes']:,} bytes)")
    return EXIT_OK


def cmd_bench_kernels(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.kernels import KernelsBench, run_kernels_bench

    r = run_kernels_bench(
        KernelsBench(
            rows=args.rows,
            cols=args.cols,
            batches=tuple(args.batches),
            threads=args.threads or 0,
        )
    )
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    print(
        f"{r['shape'][0]}x{r['shape'][1]} matrices, {r['threads']} threads, ms per call; "
        f"int8 kernel: {r['int8_isa'] or 'not built'}"
    )
    for row in r["results"]:
        i8 = (
            f"  int8 {row['int8_ms']:7.3f}  x{row['int8_speedup']:.2f} vs fused"
            if row["int8_ms"] is not None
            else ""
        )
        i8 += "".join(f"  {isa} {ms:.3f}" for isa, ms in row["int8_isa_ms"].items())
        print(
            f"  {row['type']:<5} rows {row['rows']:>3}  fused {row['fused_ms']:7.3f}  "
            f"dequantize+matmul {row['dequant_matmul_ms']:7.3f}  x{row['speedup']:.1f}{i8}"
        )
    return EXIT_OK


def _cells(*values: Any) -> str:
    """Figures in 10-wide columns, `-` where one is missing."""
    return " ".join(f"{v:10.2f}" if isinstance(v, int | float) else f"{'-':>10}" for v in values)


def cmd_bench_model(args: argparse.Namespace, settings: Settings) -> int:
    import os
    from dataclasses import asdict

    from kvq.bank.options import BankOptions
    from kvq.quant import qdot
    from kvq.tools.bench.model import PROMPT, ModelBench, run_model_bench

    cfg = ModelBench(
        args.model,
        threads=args.threads or os.cpu_count() or 1,
        tokens=args.tokens,
        rounds=args.rounds,
        sequences=tuple(args.sequences),
        prompt=args.prompt or PROMPT,
        llama=not args.no_llama,
        bank=asdict(BankOptions.from_settings(settings)),
        kernels=asdict(qdot.options()),
        prefill_tokens=args.prefill_tokens,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
    )
    r = run_model_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    _print_model_table(r)
    _print_model_notes(r["kvq"], r.get("llama", {}), r.get("llama_note"))
    return EXIT_OK


def _print_model_table(r: dict[str, Any]) -> None:
    """The bench's header and its figures side by side: kvq, llama.cpp, their ratio."""
    print(
        f"{r['model']} ({r['file_mb']:.1f} MB): {r['threads']} threads, {r['tokens']} "
        f"tokens, median of {r['rounds']} rounds, {r['kvq'].get('activations', 'float32')} "
        "activations"
    )
    cpu = r.get("cpu") or {}
    print(
        f"  CPU: {cpu.get('model', '?')} ({', '.join(cpu.get('flags', [])) or 'no listed flags'}); "
        f"prefill prompt {r['prefill_tokens']} tokens"
    )
    kq, ll, ratio = r["kvq"], r.get("llama", {}), r.get("ratio", {})
    print(f"  {'figure':<20} {'kvq':>10} {'llama.cpp':>10} {'kvq/llama':>10}")
    for key in (
        "load_s",
        "peak_rss_mb",
        "anon_rss_mb_load",
        "anon_rss_mb_decode",
        "prefill_tok_s",
        "ttft_s",
        "ttft_first_s",
        "prompt_tokens",
        "decode_tok_s",
        "aggregate_tok_s",
        "aggregate_gain",
    ):
        print(f"  {key:<20} {_cells(kq.get(key), ll.get(key), ratio.get(key))}")
    for n, v in (kq.get("aggregates") or {}).items():
        other = [(d.get("aggregates") or {}).get(n) for d in (ll, ratio)]
        print(f"  {'aggregate @ ' + n:<20} {_cells(v, *other)}")


def _print_model_notes(kq: dict[str, Any], ll: dict[str, Any], llama_note: str | None) -> None:
    """Below the table: the bank's hit rate, the kernel paths, the experts a layer, notes."""
    hr = kq["hit_rate"]
    if hr is not None:
        print(
            f"  bank hit rate hot {hr['hot']:.3f} cold {hr['cold']:.3f} over {hr['routed']} "
            f"routed pairs"
        )
    print(f"  bank: {kq['bank_note']}")
    paths = kq.get("paths", {})
    print(
        f"  kvq kernels: {paths.get('activations')} activations, {paths.get('int8_isa') or '-'}"
        f"; many rows: {paths.get('many_rows')}"
    )
    if ll.get("paths"):
        print(f"  llama.cpp: {ll['paths']['system_info']}")
    if "experts_per_layer_1" in kq:
        print(
            f"  distinct experts a layer: {kq['experts_per_layer_1']:.1f} at batch 1, "
            f"{kq['experts_per_layer_batch']:.1f} at {kq['aggregate_sequences']} sequences "
            f"({kq['expert_ms_per_layer_1']:.2f} / {kq['expert_ms_per_layer_batch']:.2f} ms; "
            f"{kq['expert_share_1']:.0%} / {kq['expert_share_batch']:.0%} of decode time)"
        )
    roof = kq.get("roofline")
    if roof:
        print(
            f"  batch-1 decode reads {roof['decode_bytes_mb']:.0f} MB a token: "
            f"{roof['decode_gb_s']:.1f} GB/s against a plain read's {roof['stream_gb_s']:.1f} "
            f"on the same threads ({roof['roof_share']:.0%} of the roof)"
        )
    notes = [f"{n} sequences: {v}" for n, v in (ll.get("aggregate_notes") or {}).items()]
    for note in (llama_note, ll.get("error"), *notes):
        if note:
            print(f"  llama.cpp: {note}")


# -- parser --------------------------------------------------------------------------------


def _int_list(flag: str) -> Any:
    """An argparse type for `1,2,3` (non-negative ints); bad text exits 2 naming `flag`."""

    def parse(text: str) -> list[int]:
        try:
            ids = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            ids = []
        if not ids or min(ids) < 0:
            raise argparse.ArgumentTypeError(
                f"{flag} wants non-negative ints like 1,2,3, got {text!r}"
            )
        return ids

    return parse


def _quants(text: str) -> tuple[str, ...]:
    names = (
        QUANTS if text == "all" else tuple(p.strip().lower() for p in text.split(",") if p.strip())
    )
    bad = [q for q in names if q not in QUANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--quants {text!r}: choose from {', '.join(QUANTS)} or all"
        )
    return names


def register(sub: Subparsers, bench: Subparsers) -> None:
    """model make-tiny, model inspect, model split, generate, bench experts."""
    m = sub.add_parser("model", help="model tools")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    _add_make_tiny(msub)
    _add_inspect(msub)
    _add_split(msub)
    registry.add(msub)
    _add_generate(sub)
    _add_bench_experts(bench)
    _add_bench_kernels(bench)
    _add_bench_model(bench)


def _add_make_tiny(msub: Subparsers) -> None:
    mt = msub.add_parser("make-tiny", help="write a synthetic MoE model (random weights) as GGUF")
    mt.add_argument("out", help="GGUF file to write")
    mt.add_argument("--arch", choices=ARCHS, help="default qwen3moe")
    mt.add_argument(
        "--variant",
        choices=VARIANTS,
        help="deepseek2's form: v3 (default), v2-lite (no q LoRA, softmax), "
        "kv-b (one attn_kv_b, older converters)",
    )
    mt.add_argument(
        "--quant", choices=QUANTS + MIXES, help="default f32 (preset: its own, q4_k_m or mxfp4)"
    )
    mt.add_argument("--tokenizer", choices=TOKENIZERS, help="default bpe (llama.cpp loads it)")
    mt.add_argument("--preset", choices=PRESETS, help="a real model's sizes, random weights")
    mt.add_argument("--dry-run", action="store_true", help="with --preset: print the size only")
    for name, default in _TINY_INTS:
        mt.add_argument(f"--{name}", type=int, help=f"default {default}")
    mt.add_argument("--seed", type=int, default=0, help="the same seed writes the same file")
    mt.set_defaults(fn=cmd_make_tiny)


def _add_inspect(msub: Subparsers) -> None:
    mi = msub.add_parser("inspect", help="hyper-parameters, quant types, slices, sizes, memory")
    mi.add_argument("file", help="GGUF file to read, or its http(s):// URL (header only)")
    mi.add_argument("--slice-experts", type=int, help="experts per slice (default: setting)")
    mi.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="coordinator compute dtype for the memory estimate",
    )
    mi.add_argument("--n-slots", type=int, help="sequences with a KV cache (default: setting)")
    mi.add_argument(
        "--kv-positions",
        type=int,
        default=0,
        help="KV positions per sequence (default: the model's context)",
    )
    mi.add_argument("--json", action="store_true", help="print JSON (for machines)")
    mi.set_defaults(fn=cmd_inspect)


def _add_split(msub: Subparsers) -> None:
    ms = msub.add_parser("split", help="write a backbone-only GGUF (no routed experts)")
    ms.add_argument("file", help="the full GGUF model")
    ms.add_argument(
        "--backbone",
        required=True,
        metavar="OUT",
        help="GGUF to write: every tensor but the routed experts, for a "
        "coordinator whose workers hold the experts",
    )
    ms.add_argument("--json", action="store_true", help="print JSON (for machines)")
    ms.set_defaults(fn=cmd_split)


def _add_generate(sub: Subparsers) -> None:
    g = sub.add_parser("generate", help="generate locally from a GGUF model (no Redis)")
    g.add_argument("--model", required=True, help="GGUF file")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the model's tokenizer")
    src.add_argument("--prompt-ids", type=_int_list("--prompt-ids"), help="token ids, e.g. 1,2,3")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    g.add_argument("--seed", type=int, help="reproducible sampling")
    g.add_argument("--device", help="torch device (default: KVQ_DEVICE)")
    g.add_argument("--json", action="store_true", help="print JSON (for machines)")
    g.set_defaults(fn=cmd_generate)


def _add_bench_experts(bench: Subparsers) -> None:
    be = bench.add_parser("experts", help="expert FFN GFLOP/s vs matmul; slice load MB/s")
    for name, default in (
        ("hidden", 2048),
        ("expert-ffn", 768),
        ("experts", 16),
        ("experts-used", 8),
        ("repeat", 5),
    ):
        be.add_argument(f"--{name}", type=int, default=default, help=f"default {default}")
    be.add_argument(
        "--batches",
        type=_int_list("--batches"),
        default=[1, 8, 64],
        help="tokens per call, comma list",
    )
    be.add_argument("--quants", type=_quants, default=QUANTS, help="comma list or all")
    be.add_argument("--device", help="torch device (default: KVQ_DEVICE)")
    be.add_argument("--json", action="store_true", help="print JSON (for machines)")
    be.set_defaults(fn=cmd_bench_experts)


def _add_bench_kernels(bench: Subparsers) -> None:
    bk = bench.add_parser("kernels", help="fused quantized matmul vs dequantize + matmul")
    bk.add_argument("--rows", type=int, default=2048, help="output rows of the matrix")
    bk.add_argument("--cols", type=int, default=1024, help="a multiple of 256")
    bk.add_argument(
        "--batches",
        type=_int_list("--batches"),
        default=[1, 8],
        help="rows of the input, comma list",
    )
    bk.add_argument("--threads", type=int, help="CPU threads (default: torch's count)")
    bk.add_argument("--json", action="store_true", help="print JSON (for machines)")
    bk.set_defaults(fn=cmd_bench_kernels)


def _add_bench_model(bench: Subparsers) -> None:
    bm = bench.add_parser("model", help="load, memory, prefill and decode of a GGUF vs llama.cpp")
    bm.add_argument("--model", required=True, help="GGUF file")
    bm.add_argument("--threads", type=int, help="CPU threads for both engines (default: all)")
    bm.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence")
    bm.add_argument("--rounds", type=int, default=3, help="rounds per engine, alternating")
    bm.add_argument(
        "--sequences",
        type=_int_list("--sequences"),
        default=[8],
        help="counts of sequences decoded together, comma list (aggregates; the "
        "first is aggregate_tok_s)",
    )
    bm.add_argument("--prompt", help="prompt text, tokenized by each engine (default: a line)")
    bm.add_argument(
        "--prefill-tokens",
        type=int,
        default=512,
        help="prompt length for prefill_tok_s and TTFT (0: skip)",
    )
    bm.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if installed")
    bm.add_argument("--json", action="store_true", help="print JSON (for machines)")
    bm.set_defaults(fn=cmd_bench_model)
