"""Per-sequence KV cache and the unit of work of one batched forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.errors import ModelError


class KVCache:
    """K/V of every layer for one sequence, growing (by doubling) up to the context length.

    Real models have contexts of 32k+ positions; preallocating them per sequence would cost
    gigabytes, so storage starts at `initial` positions and doubles when a pass needs more.

    `length` counts positions already stored. A forward pass writes new positions with
    `append` for every layer, then calls `advance` once; a pass that fails midway leaves
    `length` unchanged, so the same positions are simply overwritten on retry. Positions past
    the ones written are never read, so the storage is not zeroed: a fresh cache costs no
    more than the pages its positions touch (zeroing an olmoe cache's 67 MB took 2.4% of a
    saturated coordinator's time with 16-token requests).
    """

    def __init__(
        self,
        n_layers: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        initial: int = 256,
        latent_values: int = 0,
    ) -> None:
        shape = (n_layers, min(max_len, max(initial, 1)), kv_heads, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)  # [L, cap, kv, d]
        # MLA (`latent_values` > 0): a key is the latent, and the values are its first
        # `latent_values` entries, so nothing more is stored
        self.latent_values = latent_values
        v_shape = (n_layers, 0, kv_heads, 0) if latent_values else shape
        self.v = torch.empty(v_shape, device=device, dtype=dtype)  # [L, cap, kv, d]
        self.max_len = max_len
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions storable without growing."""
        return int(self.k.shape[1])

    def _reserve(self, end: int) -> None:
        """Grow the storage to hold `end` positions (doubling, capped at max_len)."""
        if end <= self.capacity:
            return
        cap = min(self.max_len, max(end, 2 * self.capacity))
        for name in ("k",) if self.latent_values else ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], cap, *old.shape[2:]))  # [L, cap, kv, d]
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def check_room(self, n_new: int) -> None:
        """ModelError if `n_new` more positions would overflow the context."""
        if self.length + n_new > self.max_len:
            raise ModelError(
                f"sequence of {self.length} + {n_new} tokens exceeds the context length "
                f"{self.max_len}; start a new sequence or shorten the prompt"
            )

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, kv, d]; v None for a latent cache) after `length`; return all keys
        and values [length+T, kv, d] (a latent cache's values: a view of its keys)."""
        end = self.length + k.shape[0]
        self._reserve(end)
        self.k[layer, self.length : end] = k
        if self.latent_values:
            return self.k[layer, :end], self.k[layer, :end, :, : self.latent_values]
        if v is None:
            raise ModelError("this KV cache stores values: append needs v")
        self.v[layer, self.length : end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def advance(self, n: int) -> None:
        """Mark `n` more positions as stored (after every layer has appended them)."""
        self.check_room(n)
        self.length += n


@dataclass
class SeqStep:
    """New tokens of one sequence for one forward pass (many for prefill, one for decode)."""

    tokens: list[int]
    cache: KVCache
