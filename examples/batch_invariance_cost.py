"""What batch invariance (X17, `KVQ_BATCH_INVARIANT`) costs on one model: one process, one
backbone, rounds alternating the setting on and off (the order flipped every round), each
case timed in CPU seconds of this process on one thread (a busy shared machine moves wall
times by +-50 % a round; the CPU time of one thread moves by about 1 %). Prints the best
per case and setting, and after/before.

    PYTHONPATH=. python examples/batch_invariance_cost.py MODEL.gguf [ROUNDS]

Cases: one decode step of 1, 8 and 32 sequences (16-token prompts read first), best of 3;
a 512-token prompt read in one pass. `off` runs the plain torch products and functions, as
before X17; `on` the row-invariant ones (`kvq.model.rowwise`).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from kvq.cli import configure_kernels
from kvq.config import load_settings
from kvq.model import Backbone, KVCache
from kvq.model.cache import SeqStep
from kvq.quant import qdot

SEQS = (1, 8, 32)
PROMPT = 512


def main(model: str, rounds: int) -> None:
    torch.set_num_threads(1)
    configure_kernels(load_settings())
    bb = Backbone.from_gguf(model)
    gen = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(100, bb.meta.vocab_size - 100, (n,), generator=gen).tolist()

    def cpu_s(steps: list[SeqStep]) -> float:
        t0 = time.process_time()
        bb.forward(steps)
        return time.process_time() - t0

    caches: dict[int, list[KVCache]] = {}
    for n in SEQS:
        caches[n] = [bb.new_cache() for _ in range(n)]
        bb.forward([SeqStep(toks(16), c) for c in caches[n]])
    best: dict[str, dict[str, float]] = {}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            qdot.configure(dataclasses.replace(qdot.options(), batch_invariant=on))
            side = "on" if on else "off"
            for n in SEQS:
                s = min(cpu_s([SeqStep(toks(1), c) for c in caches[n]]) for _ in range(3))
                _keep(best, f"decode, {n} sequences", side, s)
            _keep(
                best,
                f"prefill, {PROMPT} tokens",
                side,
                cpu_s([SeqStep(toks(PROMPT), bb.new_cache())]),
            )
    for case, v in best.items():
        print(f"{case}: off {v['off']:.4f} s, on {v['on']:.4f} s, on/off {v['on'] / v['off']:.3f}")


def _keep(best: dict[str, dict[str, float]], case: str, side: str, s: float) -> None:
    d = best.setdefault(case, {})
    d[side] = min(d.get(side, float("inf")), s)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6)
