"""The long checks of the stdlib pair, kvq beside llama.cpp (llama-cpp-python, F32 KV cache):
`python -m kvq.tools.train.check_pair --work DIR [--out tests/data]`.

- `tokenize`: kvq's tokenizer (from the GGUF) and llama.cpp's give the same ids on every
  held-out file, and both give the ids the trainer's tokenizer gave;
- `perplexity`: over the first `--chunks` held-out chunks of 256 tokens, each read after BOS
  as in training, exp(mean NLL) of every prediction, by kvq and by llama.cpp, on the same ids;
- `greedy`: greedy tokens of both on held-out prompts (`stdlib-prompts.json`);
- `ngram`: `kvq bench speculative`'s n-gram draft acceptance on those prompts;
- `samples`: what kvq generates (greedy) after a few prompts.

The result is written into the record (`stdlib-pair.json`, key `checks`). The held-out
prompts (`held_out_prompts`) are written once to `stdlib-prompts.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = 8
PROMPT_CHARS = 400
SEQ = 256
F32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache in float32, as kvq keeps it


def held_out_prompts(work: Path) -> list[str]:
    """One prompt from each of the first PROMPTS held-out files that have one: the lines from
    the first `def` (at any indent) past the first third of the file, up to PROMPT_CHARS
    characters cut at a line end."""
    info = json.loads((work / "corpus.json").read_text())
    root, out = Path(info["root"]), []
    for name in info["held_out_files"]:
        text = (root / name).read_bytes().decode("utf-8", "replace")
        m = re.compile(r"^[ ]*def ", re.M).search(text, len(text) // 3)
        if m is None or "\n" not in text[m.start() : m.start() + PROMPT_CHARS]:
            continue
        cut = text[m.start() : m.start() + PROMPT_CHARS]
        out.append(cut[: cut.rindex("\n") + 1])
        if len(out) == PROMPTS:
            break
    return out


def llama(path: Path, n_ctx: int) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=F32,
        type_v=F32,
    )


def check_tokenize(model: Path, work: Path) -> dict[str, Any]:
    """Held-out files tokenized by kvq, llama.cpp and the trainer's tokenizer."""
    from tokenizers import Tokenizer

    from kvq.text import load_tokenizer

    info = json.loads((work / "corpus.json").read_text())
    ours, theirs = load_tokenizer(model), llama(model, 64)
    trainer = Tokenizer.from_str((work / "tokenizer.json").read_text())
    same_llama = same_trainer = tokens = 0
    for name in info["held_out_files"]:
        text = (Path(info["root"]) / name).read_bytes().decode("utf-8", "replace")
        ids = ours.encode(text, add_bos=False)
        same_llama += ids == theirs.tokenize(text.encode(), add_bos=False, special=False)
        same_trainer += ids == trainer.encode(text, add_special_tokens=False).ids
        tokens += len(ids)
    n = len(info["held_out_files"])
    return {
        "files": n,
        "tokens": tokens,
        "same_as_llama_cpp": same_llama,
        "same_as_trainer": same_trainer,
    }


def check_perplexity(model: Path, work: Path, chunks: int) -> dict[str, Any]:
    """exp(mean NLL) by kvq and by llama.cpp over the same held-out chunks."""
    from kvq.model import Backbone, SeqStep

    held = np.load(work / "held.npy").astype(np.int64)
    bb, llm = Backbone.from_gguf(model), llama(model, SEQ + 1)
    nll = {"kvq": 0.0, "llama_cpp": 0.0}
    t0 = time.monotonic()
    for c in range(chunks):
        ids = [0, *held[c * SEQ : (c + 1) * SEQ].tolist()]
        ours = bb.forward([SeqStep(ids[:-1], bb.new_cache(), verify=True)]).double().numpy()
        llm.reset()
        llm.eval(ids[:-1])
        theirs = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        for key, logits in (("kvq", ours), ("llama_cpp", theirs)):
            nll[key] += _nll(logits, ids[1:])
    n = chunks * SEQ
    ppl = {k: round(math.exp(v / n), 4) for k, v in nll.items()}
    gap = abs(ppl["kvq"] / ppl["llama_cpp"] - 1)
    return {
        "chunks": chunks,
        "tokens": n,
        "ppl": ppl,
        "relative_gap": round(gap, 6),
        "s": round(time.monotonic() - t0, 1),
    }


def _nll(logits: np.ndarray, targets: list[int]) -> float:
    """Summed NLL of `targets` under logits [T, V] (float64)."""
    m = logits.max(-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return float((logz - logits[np.arange(len(targets)), targets]).sum())


def check_greedy(model: Path, prompts: list[str], n: int) -> dict[str, Any]:
    """Greedy tokens of kvq and llama.cpp after each prompt; where they part."""
    from kvq.model import Backbone, SeqStep
    from kvq.text import load_tokenizer

    bb, tok, llm = Backbone.from_gguf(model), load_tokenizer(model), llama(model, 1024)
    same, parts = 0, []
    for p in prompts:
        ids = tok.encode(p)
        cache, ours = bb.new_cache(), list[int]()
        logits = bb.forward([SeqStep(ids, cache)])[0]
        llm.reset()
        llm.eval(ids)
        theirs = []
        for _ in range(n):
            ours.append(int(logits.argmax()))
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            logits = bb.forward([SeqStep([ours[-1]], cache)])[0]
            llm.eval([theirs[-1]])
        same += ours == theirs
        parts.append(
            next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), n)
        )
    return {"prompts": len(prompts), "tokens": n, "identical": same, "first_difference": parts}


def samples(model: Path, prompts: list[str], n: int) -> list[dict[str, str]]:
    """kvq's greedy continuation of each prompt's last lines."""
    from kvq.model import Backbone
    from kvq.model.generate import generate
    from kvq.text import load_tokenizer

    bb, tok = Backbone.from_gguf(model), load_tokenizer(model)
    return [
        {"prompt": p, "completion": tok.decode(generate(bb, tok.encode(p), n))} for p in prompts
    ]


def check_ngram(model: Path, prompts: list[str]) -> dict[str, Any]:
    """`kvq bench speculative --prompts`: n-gram drafts' acceptance on held-out prompts."""
    from kvq.tools.bench.speculative import SpeculativeBench, run_speculative_bench

    out = run_speculative_bench(
        SpeculativeBench(str(model), sequences=(1,), tokens=64, rounds=1, prompts=tuple(prompts))
    )
    d = out["drafts"]["1"]
    return {
        "acceptance": d["acceptance"],
        "tokens_per_pass": d["tokens_per_pass"],
        "speedup": out["speedup"]["1"],
        "same": out["same"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="stdlib_pair's work folder")
    ap.add_argument("--out", type=Path, default=Path("tests/data"))
    ap.add_argument("--chunks", type=int, default=32, help="held-out chunks of 256 tokens")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--only", choices=("main", "draft"), help="check one model (others kept)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    prompts_path = args.out / "stdlib-prompts.json"
    if not prompts_path.is_file():
        prompts_path.write_text(json.dumps(held_out_prompts(args.work), indent=1) + "\n")
    prompts = json.loads(prompts_path.read_text())
    record_path = args.out / "stdlib-pair.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    checks: dict[str, Any] = record.get("checks", {})
    for which, name in (("main", "stdlib-moe.gguf"), ("draft", "stdlib-draft.gguf")):
        if args.only not in (None, which):
            continue
        model = args.out / name
        checks[which] = {
            "tokenize": check_tokenize(model, args.work),
            "perplexity": check_perplexity(model, args.work, args.chunks),
            "greedy": check_greedy(model, prompts[:4], args.greedy_tokens),
        }
        print(json.dumps({which: checks[which]}), flush=True)
    if args.only in (None, "main"):
        checks["main"]["ngram"] = check_ngram(args.out / "stdlib-moe.gguf", prompts)
        checks["main"]["samples"] = samples(args.out / "stdlib-moe.gguf", prompts[:3], 48)
    record["checks"] = checks
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(checks.get("main", {}).get("ngram")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
