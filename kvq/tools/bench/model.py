"""`kvq bench model`: load time, memory, prefill and decode throughput of one GGUF file in kvq, beside
llama.cpp (llama-cpp-python, the optional `bench` extra) on the same file and thread count.

Every round of every engine runs in a fresh subprocess (`python -m kvq.tools.bench.model --child
SPEC`, one JSON line back), so neither engine's memory or warm caches leak into the other's
figures; rounds alternate kvq, llama, kvq, llama, ... so a burst of load on a shared machine
hits both alike. The file is read through once before the first round (`page_cache_warm_s`),
so that no round pays for reading it from disk: llama.cpp reads all of it at load, kvq only
the experts its decode touches. It is read through again before each later kvq round
(`page_cache_rewarm_s`): llama.cpp copies (repacks) most of the weights into its own memory,
and where the file and that copy do not both fit in RAM (qwen3-30b-a3b's 18.6 GB on a 24 GB
machine) its round evicts the file, which kvq's next round would read back from disk while
being timed. Per engine, each figure is the median over its rounds;
`ratio` is kvq / llama.

- `load_s`: kvq `Backbone.from_gguf` (dense weights dequantized once; experts and the token
  embedding stay mapped, encoded); llama `Llama(...)`.
- `peak_rss_mb`: VmHWM at the end; `anon_rss_mb_load|decode`: RssAnon after the load and after
  the decodes. llama.cpp maps the file, so its weights count in RSS but not in RssAnon.
- `prefill_tok_s`, `ttft_s`, `ttft_first_s` (`prefill_tokens`, default 512; `kvq.tools.bench.prefill`):
  right after the load, two prompts of that many tokens, each prefilled in one pass; the second
  gives the figures, the first (kvq mapping its experts on first touch) `ttft_first_s`. `paths`:
  what each engine computed with (kvq: activations, the int8 kernel's instruction set and its
  many-row kernel; llama.cpp: its system info line); `cpu`: the CPU's model and features.
- `decode_tok_s`: batch 1, greedy, EOS ignored, from the first generated token to the last
  (the prompt's prefill excluded): kvq `kvq.model.generate`, llama `Llama.generate`.
- `aggregates` (both engines): {"N": tok/s} for each count N of `sequences` (8 by default), in
  order, in the same round: kvq runs N sequences through the coordinator's path, an `Engine`
  whose MoE runs in a `Bank` built as the coordinator builds it; tokens after each sequence's
  first, over the time after the first step. llama: the same prompts through llama.cpp's
  multi-sequence batch API (`kvq.tools.bench.llama_batch`) after its batch-1 decode, in a context
  that holds all N (null, with the reason in `aggregate_notes`, where llama.cpp refuses it).
  `aggregate_tok_s` is the first count's (`batch`), as before; `hit_rate`: the bank's hot/cold
  shares of routed pairs over that first count. `ratio.aggregates`: kvq / llama per count.
- `aggregate_gain` (both engines): `aggregate_tok_s` / `decode_tok_s`, the engine's own gain
  from batching. kvq also reports `experts_per_layer_1|batch` (distinct experts one decode
  call routes to, batch 1 and `batch` sequences), `expert_ms_per_layer_1|batch` and
  `expert_share_1|batch` (the expert calls' share of the decode's wall time): with top-k of
  E experts, `batch` sequences touch up to `batch` x k distinct experts a layer, and each
  distinct expert's weights are read (and unpacked) once a step, so the expert work of a step
  grows with that union, not with the batch.
- `roofline` (kvq): the bytes of weights a batch-1 decode step reads, the GB/s that makes at
  `decode_tok_s`, a plain read of as many bytes on the same threads and the share of it
  reached (`kvq.tools.bench.roofline`; the first round's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvq.errors import ConfigError, ModelError
from kvq.tools.bench.prefill import PREFILL_TOKENS, cpu_features, kvq_prefill, llama_prefill

PROMPT = "The quick brown fox jumps over the lazy dog while the rain in Spain falls mainly"
MB = 1e6
NOTE_NO_LLAMA = (
    "llama_cpp is not importable: pip install 'kvq[bench]' (docs/models.md, 'Benchmarks: "
    "model', gives the build flags)"
)
RATIO_KEYS = (
    "load_s",
    "peak_rss_mb",
    "anon_rss_mb_load",
    "anon_rss_mb_decode",
    "decode_tok_s",
    "aggregate_tok_s",
    "prefill_tok_s",
    "ttft_s",
    "ttft_first_s",
)


@dataclass(frozen=True)
class ModelBench:
    """One `kvq bench model` run. `bank`: BankOptions fields for the aggregate run;
    `kernels`: `kvq.quant.qdot.KernelOptions` fields (int8 activations or not)."""

    model: str
    threads: int = 2
    tokens: int = 32
    rounds: int = 3
    sequences: tuple[int, ...] = (8,)  # the aggregate's counts; the first is `batch`
    prompt: str = PROMPT
    llama: bool = True
    bank: dict[str, Any] | None = None
    kernels: dict[str, Any] | None = None
    prefill_tokens: int = PREFILL_TOKENS  # 0: no prefill figures
    omp_wait_policy: str = ""  # OMP_WAIT_POLICY as the CLI found it (it sets PASSIVE unless set)

    @property
    def batch(self) -> int:
        """The first count of `sequences`: the one `aggregate_tok_s` reports."""
        return self.sequences[0]

    def check(self) -> None:
        """ConfigError naming the first bad value."""
        for name in ("threads", "tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench model --{name} {getattr(self, name)} must be >= 1")
        counts = ",".join(map(str, self.sequences))
        if not self.sequences or min(self.sequences) < 1:
            raise ConfigError(f"bench model --sequences {counts!r}: each count must be >= 1")
        if len(set(self.sequences)) < len(self.sequences):
            raise ConfigError(f"bench model --sequences {counts!r}: give each count once")
        if self.prefill_tokens < 0:
            raise ConfigError(f"bench model --prefill-tokens {self.prefill_tokens} must be >= 0")
        if not self.prompt:
            raise ConfigError("bench model --prompt must not be empty")
        if not Path(self.model).is_file():
            raise ConfigError(f"bench model --model {self.model!r}: no such file")


def llama_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_model_bench(cfg: ModelBench) -> dict[str, Any]:
    """Run the rounds and return the figures as plain values (see the module docstring)."""
    cfg.check()
    cfg = replace(cfg, model=str(Path(cfg.model).resolve()))
    use_llama = cfg.llama and llama_available()
    warm_s = read_through(cfg.model)
    runs: dict[str, list[dict[str, Any]]] = {"kvq": [], "llama": []}
    rewarm_s: list[float] = []
    for i in range(cfg.rounds):
        if i > 0:
            rewarm_s.append(read_through(cfg.model))
        kvq_run = _spawn("kvq", cfg)
        if "error" in kvq_run:
            raise ModelError(f"kvq could not run {cfg.model}: {kvq_run['error']}")
        runs["kvq"].append(kvq_run)
        if use_llama:
            runs["llama"].append(_spawn("llama", cfg))
    out: dict[str, Any] = {
        "model": cfg.model,
        "file_mb": os.path.getsize(cfg.model) / MB,
        "threads": cfg.threads,
        "tokens": cfg.tokens,
        "rounds": cfg.rounds,
        "batch": cfg.batch,
        "sequences": list(cfg.sequences),
        "prompt": cfg.prompt,
        "page_cache_warm_s": warm_s,
        "page_cache_rewarm_s": rewarm_s,
        "cpu": cpu_features(),
        "prefill_tokens": cfg.prefill_tokens,
        "kvq": _summary(runs["kvq"]),
    }
    if not use_llama:
        out["llama_note"] = "skipped (--no-llama)" if not cfg.llama else NOTE_NO_LLAMA
        return out
    good = [r for r in runs["llama"] if "error" not in r]
    if not good:
        out["llama"] = {"error": runs["llama"][0]["error"]}
        return out
    out["llama"] = _summary(good)
    if len(good) < len(runs["llama"]):
        out["llama"]["failed_rounds"] = [r["error"] for r in runs["llama"] if "error" in r]
    out["ratio"] = {k: _ratio(out["kvq"].get(k), out["llama"].get(k)) for k in RATIO_KEYS}
    kq_agg, ll_agg = out["kvq"].get("aggregates") or {}, out["llama"].get("aggregates") or {}
    out["ratio"]["aggregates"] = {n: _ratio(kq_agg.get(n), ll_agg.get(n)) for n in kq_agg}
    return out


def read_through(path: str, chunk: int = 64 << 20) -> float:
    """Read the file once, untimed by the rounds, so that every round finds it in the page
    cache: llama.cpp reads all of it at load, kvq only the experts a decode touches, so a
    cold cache would slow kvq's first round alone. Returns the seconds it took."""
    t0 = time.perf_counter()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the numeric figures over rounds, the other fields of the first round, and
    every round's numeric figures."""
    first = runs[0]
    keys = [k for k, v in first.items() if _is_number(v)]
    med: dict[str, Any] = {k: _median([r[k] for r in runs if _is_number(r.get(k))]) for k in keys}
    if isinstance(first.get("aggregates"), dict):
        med["aggregates"] = _median_map([r.get("aggregates") or {} for r in runs])
        keys.append("aggregates")
    return first | med | {"per_round": [{k: r.get(k) for k in keys} for r in runs]}


def _median_map(maps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key of the first map, the median of the rounds' numbers (None where none has one)."""
    out: dict[str, Any] = {}
    for key in maps[0]:
        values = [m[key] for m in maps if _is_number(m.get(key))]
        out[key] = _median(values) if values else None
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _median(values: list[int | float]) -> int | float:
    """The median, kept an int for counts (token counts, threads) that are ints every round."""
    m = statistics.median(values)
    return int(m) if all(isinstance(v, int) for v in values) and float(m).is_integer() else m


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def _spawn(engine: str, cfg: ModelBench) -> dict[str, Any]:
    """One round of `engine` in a fresh interpreter; its JSON line, or {"error": ...}."""
    spec = json.dumps({"engine": engine, **asdict(cfg)})
    root = Path(__file__).resolve().parents[3]  # -m finds this kvq, installed or not
    proc = subprocess.run(
        [sys.executable, "-m", "kvq.tools.bench.model", "--child", spec],
        capture_output=True,
        text=True,
        cwd=root,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    result: dict[str, Any] = {}
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            result = {}
    if proc.returncode != 0 or not result:
        result = {"error": f"exit {proc.returncode}: {_stderr_hint(proc.stderr)}"}
    elif "error" in result:
        result["error"] = f"{result['error']} ({_stderr_hint(proc.stderr)})"
    return result


def _stderr_hint(stderr: str) -> str:
    """The lines of a child's stderr that explain a failure (llama.cpp logs the reason of a
    failed load only there), else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    why = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return "; ".join(why[-3:]) if why else (lines[-1] if lines else "no output")


# -- children ------------------------------------------------------------------------------


def _status_mb(field: str) -> float:
    """A kB field of /proc/self/status in MB (0.0 where the file or field is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return 0.0


def _decode_rate(stamps: list[float]) -> float:
    """Tokens per second from the perf_counter stamps of each generated token, counting the
    tokens after the first (the first one waits on the prefill)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return 0.0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def child_kvq(cfg: ModelBench) -> dict[str, Any]:
    """One kvq round: load, batch-1 decode, then the coordinator's batched path."""
    from kvq.text import load_tokenizer

    from .expert_tally import ExpertTally, span
    from .roofline import roofline

    bb, load_s = _kvq_load(cfg)
    anon_load = _status_mb("RssAnon")
    tok = load_tokenizer(cfg.model)
    prefill: dict[str, Any] = {}
    if cfg.prefill_tokens:
        prefill = kvq_prefill(
            bb,
            lambda s: tok.encode(s, add_bos=True),
            cfg.prompt,
            min(cfg.prefill_tokens, bb.meta.context_length - 1),
        )
    prompt = tok.encode(cfg.prompt, add_bos=True)
    stamps, one = _kvq_decode_one(bb, prompt, cfg)
    bank, bank_note = _coordinator_bank(bb, cfg)
    moe = bank.forward if bank is not None else bb.local_moe
    many = ExpertTally(moe, rows=cfg.batch)
    agg, agg_tokens, agg_s = _kvq_aggregate(bb, tok, cfg, cfg.batch, many, bank)
    hit_rate, aggregates = _hit_rate(bank), {str(cfg.batch): agg}
    for n in cfg.sequences[1:]:
        aggregates[str(n)] = _kvq_aggregate(bb, tok, cfg, n, moe, bank)[0]
    decode = _decode_rate(stamps)
    return (
        {"roofline": roofline(bb, decode, cfg.threads)}
        | {
            "load_s": load_s,
            "peak_rss_mb": _status_mb("VmHWM"),
            "anon_rss_mb_load": anon_load,
            "anon_rss_mb_decode": _status_mb("RssAnon"),
            "prompt_tokens": len(prompt),
            "decode_tokens": len(stamps),
            "decode_tok_s": decode,
            "aggregate_tok_s": agg,
            "aggregate_gain": _ratio(agg, decode),
            "aggregate_sequences": cfg.batch,
            "aggregate_tokens": agg_tokens,
            "aggregates": aggregates,
            "hit_rate": hit_rate,
            "bank_note": bank_note,
            "experts_per_layer_1": one.mean_distinct(),
            "experts_per_layer_batch": many.mean_distinct(),
            "expert_ms_per_layer_1": one.mean_ms(),
            "expert_ms_per_layer_batch": many.mean_ms(),
            "expert_share_1": one.share(span(stamps)),
            "expert_share_batch": many.share(agg_s),
        }
        | _kvq_runtime(cfg.omp_wait_policy)
        | prefill
    )


def _kvq_load(cfg: ModelBench) -> tuple[Any, float]:
    """Threads and kernels set, the backbone loaded: it and the seconds the load took."""
    import torch

    from kvq.model import Backbone
    from kvq.quant import kernels, qdot

    torch.set_num_threads(cfg.threads)
    qdot.configure(qdot.KernelOptions(**(cfg.kernels or {})))
    kernels.int8_active()  # build or load the int8 kernel before the clock starts
    t0 = time.perf_counter()
    bb = Backbone.from_gguf(cfg.model)
    return bb, time.perf_counter() - t0


def _kvq_decode_one(bb: Any, prompt: list[int], cfg: ModelBench) -> tuple[list[float], Any]:
    """Batch-1 greedy decode: each token's time stamp and the expert tally it ran through."""
    from kvq.model.generate import generate

    from .expert_tally import ExpertTally

    stamps: list[float] = []
    one = ExpertTally(bb.local_moe, rows=1)
    generate(
        bb,
        prompt,
        cfg.tokens,
        moe=one,
        stop_at_eos=False,
        on_token=lambda _t: stamps.append(time.perf_counter()),
    )
    return stamps, one


def _kvq_runtime(omp_wait_policy: str) -> dict[str, Any]:
    """The threads, OpenMP wait policy, activations and kernel paths the round ran with."""
    import torch

    from kvq.quant import kernels, qdot

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": omp_wait_policy,
        "activations": qdot.options().activations,
        "int8_kernel": kernels.int8_active(),
        "paths": kernels.paths(),
    }


def _kvq_aggregate(
    bb: Any, tok: Any, cfg: ModelBench, n: int, moe: Any, bank: Any
) -> tuple[float, int, float]:
    """`n` sequences through a coordinator `Engine` until all are done: (tok/s, tokens,
    seconds), counting the tokens after each sequence's first over the time after the first
    step."""
    from kvq.coordinator.engine import Engine

    engine = Engine(bb, tok, n_slots=n)
    for i in range(n):  # distinct prompts, so no two sequences are the same work
        engine.admit(f"bench-{i}", tok.encode(f"{cfg.prompt} {i}", add_bos=True), cfg.tokens, b"")
    seqs = list(engine.active)
    engine.step(moe, lambda _s: None)  # prefill of all, first token of each
    t1 = time.perf_counter()
    while engine.busy:
        engine.step(moe, lambda _s: None)
        if bank is not None:
            bank.step()  # as the coordinator does after every engine step
    agg_s = time.perf_counter() - t1
    agg_tokens = sum(max(0, len(s.generated) - 1) for s in seqs)
    return (agg_tokens / agg_s if agg_s > 0 and agg_tokens else 0.0), agg_tokens, agg_s


def _coordinator_bank(bb: Any, cfg: ModelBench) -> tuple[Any, str]:
    """The Bank the coordinator puts over its backbone's experts, and a note on it; (None, why)
    where one cannot be built over them (the Engine then runs the backbone's local experts)."""
    import torch

    from kvq.bank import Bank, BankOptions
    from kvq.errors import BankError

    try:
        bank = Bank(bb.experts.values(), BankOptions(**(cfg.bank or {})), torch.device("cpu"))
    except (BankError, TypeError, AttributeError) as exc:
        return None, f"no bank over these experts ({type(exc).__name__}: {exc}); local experts"
    return bank, bank.describe()


def _hit_rate(bank: Any) -> dict[str, Any] | None:
    if bank is None:
        return None
    st = bank.stats()
    r = st["rates"]
    return {
        "hot": r.hot,
        "cold": r.cold,
        "routed": r.routed,
        "hot_bytes": st["hot_bytes"],
        "mode": st["mode"],
    }


def child_llama(cfg: ModelBench) -> dict[str, Any]:
    """One llama.cpp round: load, batch-1 greedy decode; {"error": ...} if it cannot load."""
    from llama_cpp import Llama

    from .llama_batch import decode_together
    from .prefill import llama_system_info

    # BPE never has more tokens than bytes; one batch takes the whole prefill prompt
    n_ctx = max(len(cfg.prompt.encode()) + cfg.tokens, cfg.prefill_tokens) + 16
    n_batch = max(512, cfg.prefill_tokens)
    t0 = time.perf_counter()
    try:  # verbose: llama.cpp logs why a load failed, and only when verbose
        llm = Llama(
            model_path=cfg.model,
            n_threads=cfg.threads,
            n_threads_batch=cfg.threads,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            verbose=True,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        return {"error": f"llama.cpp could not load the file: {exc}"}
    load_s = time.perf_counter() - t0
    anon_load = _status_mb("RssAnon")
    prefill = llama_prefill(llm, cfg.prompt, cfg.prefill_tokens) if cfg.prefill_tokens else {}
    prompt = llm.tokenize(cfg.prompt.encode(), add_bos=True)
    stamps: list[float] = []
    for _tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) >= cfg.tokens:
            break
    aggregates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for n in cfg.sequences:
        prompts = [llm.tokenize(f"{cfg.prompt} {i}".encode(), add_bos=True) for i in range(n)]
        try:
            aggregates[str(n)] = decode_together(llm, prompts, cfg.tokens, cfg.threads)[1]
        except RuntimeError as exc:
            aggregates[str(n)], notes[str(n)] = None, str(exc)
    agg, agg_note = aggregates[str(cfg.batch)], notes.get(str(cfg.batch), "")
    decode = _decode_rate(stamps)
    return {
        "load_s": load_s,
        "peak_rss_mb": _status_mb("VmHWM"),
        "anon_rss_mb_load": anon_load,
        "anon_rss_mb_decode": _status_mb("RssAnon"),
        "prompt_tokens": len(prompt),
        "decode_tokens": len(stamps),
        "decode_tok_s": decode,
        "aggregate_tok_s": agg,
        "aggregate_gain": _ratio(agg, decode),
        "aggregate_sequences": cfg.batch,
        "aggregate_note": agg_note,
        "aggregates": aggregates,
        "aggregate_notes": notes,
        "paths": {"system_info": llama_system_info()},
    } | prefill


def _child_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--child":
        print("usage: python -m kvq.tools.bench.model --child SPEC (started by kvq bench model)")
        return 2
    spec = json.loads(argv[1])
    engine = spec.pop("engine")
    cfg = ModelBench(**spec | {"sequences": tuple(spec["sequences"])})
    result = child_kvq(cfg) if engine == "kvq" else child_llama(cfg)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
