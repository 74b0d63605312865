"""Train the stdlib model pair: `python -m kvq.tools.train.stdlib_pair --work DIR --out DIR`.

Steps (a rerun after a crash resumes: the streams are kept in `--work`, training restarts
from the model's last checkpoint there):

1. `prepare`: the corpus (`kvq.tools.train.corpus`), the 4096-token BPE, the token streams;
2. `main`: the `qwen3moe` target (`MAIN`), checkpointed every 50 steps, written as
   `stdlib-moe.gguf` (Q8_0 matrices);
3. `draft`: the draft (`DRAFT`, same vocabulary), written as `stdlib-draft.gguf` (F16);
4. the record, `stdlib-pair.json` in `--out`: configs, seeds, corpus digest, loss curves,
   held-out loss, wall times, the machine.

`--only main|draft` runs one model (two such processes may run side by side with their own
`--out`); `--export` writes the GGUF from the model's checkpoint without training (after an
interrupted run). Torch runs on `--threads` threads, 1 by default: on a 2-CPU machine shared
with other work, one thread a process ran a step 5x faster than two (OpenMP's threads wait on
each other whenever one is descheduled). Every batch and the initial weights come from the
seeds, so a rerun on the same machine, torch and thread count gives the same losses bit for
bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvq.tools.train import corpus as cp
from kvq.tools.train.export import write_gguf
from kvq.tools.train.loop import TrainConfig, held_out_chunks, mean_nll, summary, train
from kvq.tools.train.net import NetConfig

SEED = 49
VOCAB = 4096
MAIN = NetConfig(VOCAB, 4, 256, 4, 2, 64, 16, 2, 256, context=1024)
DRAFT = NetConfig(VOCAB, 2, 128, 4, 2, 32, 4, 2, 256, context=1024)
MAIN_TRAIN = TrainConfig(
    SEED,
    steps=1200,
    batch=8,
    seq=256,
    lr=3e-3,
    warmup=50,
    eval_every=50,
    eval_chunks=8,
    max_minutes=56,
)
DRAFT_TRAIN = TrainConfig(
    SEED + 1,
    steps=800,
    batch=8,
    seq=256,
    lr=4e-3,
    warmup=50,
    eval_every=50,
    eval_chunks=8,
    max_minutes=40,
)
FILES = {"main": "stdlib-moe.gguf", "draft": "stdlib-draft.gguf"}
QUANT = {"main": "q8_0", "draft": "f16"}
RECORD_CHUNKS = 64  # held-out chunks of 256 tokens in the record's final loss


def prepare(work: Path) -> dict[str, Any]:
    """Corpus, tokenizer and streams into `work` (kept if there)."""
    meta = work / "corpus.json"
    if meta.is_file():
        return dict(json.loads(meta.read_text()))
    t0 = time.monotonic()
    c = cp.stdlib_corpus()
    texts = c.text(c.train)
    tok = cp.train_tokenizer(texts, VOCAB)
    (work / "tokenizer.json").write_text(tok.to_str())
    np.save(work / "train.npy", cp.token_stream(tok, texts))
    np.save(work / "held.npy", cp.token_stream(tok, c.text(c.held_out)))
    info = {
        "root": str(c.root),
        "python": platform.python_version(),
        "train_files": len(c.train),
        "held_out_files": list(c.held_out),
        "train_bytes": sum(len(t.encode()) for t in texts),
        "sha256": c.digest(),
        "pre_tokenizer": cp.PRE,
        "vocab": VOCAB,
        "train_tokens": int(len(np.load(work / "train.npy"))),
        "held_out_tokens": int(len(np.load(work / "held.npy"))),
        "prepare_s": round(time.monotonic() - t0, 1),
    }
    meta.write_text(json.dumps(info, indent=1))
    return info


def run_model(
    which: str, work: Path, out: Path, export_only: bool, stop_at: int = 0
) -> dict[str, Any]:
    """Train (or resume, or only export) one model; its part of the record."""
    net, cfg = (MAIN, MAIN_TRAIN) if which == "main" else (DRAFT, DRAFT_TRAIN)
    if stop_at:
        cfg = replace(cfg, stop_at=stop_at, max_minutes=0.0)
    stream, held = np.load(work / "train.npy"), np.load(work / "held.npy")
    ckpt = work / f"{which}.pt"
    logf = (work / f"{which}.log").open("a")

    def log(line: str) -> None:
        logf.write(line + "\n")
        logf.flush()

    if export_only:
        cfg = TrainConfig(**{**asdict(cfg), "steps": 0})
    model, state = train(net, cfg, stream, held, ckpt, log)
    nll = mean_nll(model, held_out_chunks(held, cfg.seq, RECORD_CHUNKS))
    tokens, merges = cp.vocab_lists(_tokenizer(work))
    name = f"kvq-stdlib-{which}-{net.layers}L-{net.experts}E"
    write_gguf(out / FILES[which], model, tokens, merges, name=name, quant=QUANT[which])
    return {
        "file": FILES[which],
        "quant": QUANT[which],
        "params": model.n_params(),
        "net": net.as_dict(),
        "train": asdict(cfg) if not export_only else "from checkpoint",
        **summary(state),
        "stopped_early": state.stopped_early,
        "held_out": {
            "chunks": RECORD_CHUNKS,
            "seq": cfg.seq,
            "nll": round(nll, 4),
            "ppl": round(math.exp(nll), 3),
            "computed_by": "torch float32, before quantization",
        },
        "bytes": (out / FILES[which]).stat().st_size,
    }


def _tokenizer(work: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str((work / "tokenizer.json").read_text())


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="checkpoints, streams, logs")
    ap.add_argument("--out", type=Path, default=Path("tests/data"), help="GGUFs and record")
    ap.add_argument("--only", choices=("main", "draft"), default=None)
    ap.add_argument("--export", action="store_true", help="write GGUFs from the checkpoints")
    ap.add_argument(
        "--stop-at",
        type=int,
        default=0,
        help="stop after this step, no time cap (a rerun of "
        "a run the time cap stopped: the record's steps_done)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: see the docstring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / "stdlib-pair.json"
    record: dict[str, Any] = {}
    if record_path.is_file():
        record = json.loads(record_path.read_text())
    record["seed"] = SEED
    record["corpus"] = prepare(args.work)
    record["machine"] = machine()
    for which in ("main", "draft"):
        if args.only in (None, which):
            t0 = time.monotonic()
            record[which] = run_model(which, args.work, args.out, args.export, args.stop_at)
            record[which]["wall_s"] = round(time.monotonic() - t0, 1)
            record_path.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
