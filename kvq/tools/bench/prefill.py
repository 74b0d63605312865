"""Prefill for `kvq bench model`: the time to first token of a long prompt in kvq and in
llama.cpp, in the same rounds, and what each engine computes with on this CPU.

Both engines get a prompt of exactly `n` tokens (512 by default), built the same way from the
bench's line: numbered copies joined until the engine's own tokenizer gives n tokens (BOS
first), cut at n. A round prefills twice, right after the load, each time a prompt the engine
has not seen (no prefix cache helps):

- `ttft_first_s`: the first prompt. kvq maps its experts lazily, so this one also pays for
  mapping (page-faulting) the experts the prompt touches; llama.cpp read every weight at load.
- `ttft_s` and `prefill_tok_s` (= n / ttft_s): the second, the steady figure a server sees.

TTFT is the forward pass over the prompt plus the greedy pick of the first token: kvq's
`generate` up to its first token, llama.cpp's `Llama.eval` of the prompt in one batch
(n_batch = n_ubatch >= n) and the argmax of its logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvq.machine import CPU_FLAGS

PREFILL_TOKENS = 512


def prompt_ids(encode: Callable[[str], list[int]], line: str, n: int, salt: int) -> list[int]:
    """Exactly `n` token ids of numbered copies of `line` (`salt` makes prompts differ);
    `encode` is the engine's tokenizer (text -> ids, BOS first)."""
    per = max(1, len(encode(line)) - 1)
    copies = n // per + 2
    while True:
        ids = encode(" ".join(f"{line} ({salt}.{i})" for i in range(copies)))
        if len(ids) >= n:
            return ids[:n]
        copies *= 2


def kvq_prefill(bb: Any, encode: Callable[[str], list[int]], line: str, n: int) -> dict[str, Any]:
    """The prefill figures of a loaded `Backbone` (see the module docstring)."""
    from kvq.model.generate import generate

    out: dict[str, Any] = {"prefill_tokens": n}
    for key, salt in (("ttft_first_s", 0), ("ttft_s", 1)):
        ids = prompt_ids(encode, line, n, salt)
        t0 = time.perf_counter()
        generate(bb, ids, 1, stop_at_eos=False)  # the first token is the whole call
        out[key] = time.perf_counter() - t0
    out["prefill_tok_s"] = n / out["ttft_s"]
    return out


def llama_prefill(llm: Any, line: str, n: int) -> dict[str, Any]:
    """The same figures for a loaded `llama_cpp.Llama` (n_ctx > n, n_batch >= n); the
    context is left empty."""
    import ctypes

    import numpy as np

    out: dict[str, Any] = {"prefill_tokens": n}
    for key, salt in (("ttft_first_s", 0), ("ttft_s", 1)):
        ids = prompt_ids(lambda s: llm.tokenize(s.encode(), add_bos=True), line, n, salt)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        ptr = ctypes.cast(llm._ctx.get_logits(), ctypes.POINTER(ctypes.c_float))
        int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).argmax())  # the first token
        out[key] = time.perf_counter() - t0
    llm.reset()
    out["prefill_tok_s"] = n / out["ttft_s"]
    return out


def llama_system_info() -> str:
    """llama.cpp's own line on the CPU features and backends it was built with and uses."""
    import llama_cpp

    return str(llama_cpp.llama_print_system_info().decode(errors="replace")).strip()


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """This CPU's model name and which of CPU_FLAGS it has ({} where /proc/cpuinfo is not)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}
