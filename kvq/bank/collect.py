"""Routing histogram from a traffic sample (B3): run prompts through the model, count routings.

Every routed (token, expert) pair counts, prompt tokens (prefill) and generated ones alike,
because both reach the experts. Counting happens on the device (`index_add_`) and is read
once at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kvq.bank.hist import Histogram, merge_counts
from kvq.errors import BankError
from kvq.gguf import slice_nbytes
from kvq.model import Backbone, expert_forward
from kvq.model.generate import generate
from kvq.text import load_tokenizer

log = logging.getLogger(__name__)


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise BankError(f"prompts file {str(path)!r} does not exist") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise BankError(f"prompts file {str(path)!r} has no non-empty line")
    return prompts


def collect_histogram(
    model_path: str | Path,
    prompts: Sequence[str],
    tokens: int,
    device: str | torch.device = "cpu",
) -> Histogram:
    """Generate `tokens` tokens (greedy) for each prompt and count routings per layer."""
    if tokens < 0:
        raise BankError(f"--tokens {tokens} must be >= 0")
    bb = Backbone.from_gguf(model_path, device=device)
    meta = bb.meta
    tok = load_tokenizer(model_path)
    e = meta.expert_count
    counts = torch.zeros(meta.block_count, e, dtype=torch.int64, device=bb.device)  # [L, E]

    def counting_moe(
        layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        flat = ids.reshape(-1)  # [T*k]
        counts[layer].index_add_(0, flat, torch.ones_like(flat))
        return expert_forward(bb.experts[layer], x, ids, w)

    for i, prompt in enumerate(prompts):
        generate(bb, tok.encode(prompt), tokens, moe=counting_moe, stop_at_eos=False)
        log.debug("prompt %d/%d done", i + 1, len(prompts))
    sizes = {
        layer: [slice_nbytes(meta, layer, j, j + 1) for j in range(e)] for layer in meta.moe_layers
    }
    host = counts.cpu().tolist()
    per_layer = {layer: host[layer] for layer in meta.moe_layers}
    return merge_counts(meta.name or Path(model_path).stem, per_layer, sizes)
