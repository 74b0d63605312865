"""Batch-1 decode tok/s of kvq int8 with one C call per MoE layer (F), kvq int8 matrix by
matrix (U) and llama.cpp (L, needs llama-cpp-python), in ONE process, 16-token chunks in turn
(one warm-up chunk not counted), so that every ratio compares the same minute of a shared
machine. docs/limits.md quotes its figures.

    python examples/interleaved_decode.py MODEL.gguf [CHUNKS] [TOKENS]   (ENGINES=FUL default)

U is kvq with the one-call path switched off (`kvq.model.experts._int8_call` answering None),
which is what the decode ran before it.
"""

import json
import os
import statistics
import sys
import time

import torch

from kvq.model import Backbone
from kvq.model import experts as ex
from kvq.model.generate import generate
from kvq.quant import kernels, qdot
from kvq.text import load_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog while the rain in Spain falls mainly"


def main(model: str, chunks: int, n: int, engines: str) -> dict[str, object]:
    torch.set_num_threads(2)
    qdot.configure(qdot.KernelOptions(activations="int8"))
    kernels.int8_active()
    bb = Backbone.from_gguf(model)
    prompt = load_tokenizer(model).encode(PROMPT, add_bos=True)
    one_call = ex._int8_call

    def rate(stamps: list[float]) -> float:
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def kvq(fused: bool) -> float:
        ex._int8_call = one_call if fused else (lambda *a: None)  # type: ignore[assignment]
        st: list[float] = []
        generate(
            bb, prompt, n, stop_at_eos=False, on_token=lambda _t: st.append(time.perf_counter())
        )
        return rate(st)

    def llama() -> float:
        st: list[float] = []
        for _ in llm.generate(lp, top_k=1, temp=0.0, reset=True):
            st.append(time.perf_counter())
            if len(st) >= n:
                break
        return rate(st)

    if "L" in engines:
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_threads=2, n_threads_batch=2, n_ctx=128, verbose=False)
        lp = llm.tokenize(PROMPT.encode(), add_bos=True)
    res: dict[str, list[float]] = {e: [] for e in engines}
    for c in range(chunks + 1):
        for e in engines:
            r = llama() if e == "L" else kvq(e == "F")
            if c:
                res[e].append(r)
    out: dict[str, object] = {
        "median_tok_s": {e: round(statistics.median(v), 2) for e, v in res.items()},
        "chunks": {e: [round(x, 1) for x in v] for e, v in res.items()},
    }
    for a, b in (("F", "U"), ("F", "L"), ("U", "L")):
        if a in res and b in res:
            out[f"{a}/{b}"] = [round(x / y, 2) for x, y in zip(res[a], res[b], strict=True)]
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    result = main(args[0], int(args[1]) if len(args) > 1 else 4, int(args[2]) if len(args) > 2 else 16,
                  os.environ.get("ENGINES", "FUL"))  # fmt: skip
    print(json.dumps(result))
