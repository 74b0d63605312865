"""Per-sequence KV cache and the unit of work of one batched forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvq.errors import ModelError
from kvq.model.deltanet import DeltaState


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

    Sliding-window layers (`windows[layer]` = W > 0: gpt-oss's even layers, llama4's chunked
    ones, W the chunk) keep only a ring of up to `W - 1 + the longest pass` positions
    (position p in slot p % capacity; it doubles as it fills, like the full layers'), all that a
    pass reads there (`append_window`); a failed pass still leaves every position it needs
    for its retry, since it writes only slots of positions at or after `length`.

    Linear-attention layers (`recurrent`, qwen35moe's Gated DeltaNet) store no K/V: the
    sequence's fixed-size recurrent state (`state`, a `DeltaState`) stands beside the cache
    for them. A pass stages its new states there, `advance` commits them with the positions
    and `begin` (at the start of every pass) drops what a failed pass staged, so a retry
    starts again from the committed state, as it does from `length`.
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
        windows: Sequence[int] = (),
        state: DeltaState | None = None,
        held: Sequence[int] | None = None,
    ) -> None:
        """`held`: the layers whose keys are stored here (a stage holder's span, X12; the
        coordinator of a stage-grain model holds none); None: all of them."""
        self.windows = list(windows) or [0] * n_layers  # [L] 0: the layer sees everything
        if len(self.windows) != n_layers or (latent_values and any(self.windows)):
            raise ModelError(
                f"windows {self.windows} must give one per layer ({n_layers}), "
                "and a latent cache has none"
            )
        self.state = state  # the linear-attention layers' recurrent state, if any
        recurrent = set(state.layers) if state is not None else set()
        keep = set(range(n_layers) if held is None else held)
        full = [
            i for i, w in enumerate(self.windows) if w <= 0 and i not in recurrent and i in keep
        ]
        sliding = [i for i, w in enumerate(self.windows) if w > 0 and i in keep]
        # each layer's row in k/v (full layers) or in wk/wv (sliding ones)
        self._row = {i: r for rows in (full, sliding) for r, i in enumerate(rows)}
        self.window = max(self.windows, default=0)
        if len({w for w in self.windows if w > 0}) > 1:
            raise ModelError(f"sliding windows {self.windows} differ between layers")
        # the ring too starts small and doubles (llama4's chunks are 8192 positions)
        ring = (len(sliding), min(max_len, max(min(self.window, initial), 1)), kv_heads, head_dim)
        self.wk = torch.empty(ring, device=device, dtype=dtype)  # [Ls, ring, kv, d]
        self.wv = torch.empty(ring, device=device, dtype=dtype)  # [Ls, ring, kv, d]
        n_layers = len(full)
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
        row = self._row[layer]
        self.k[row, self.length : end] = k
        if self.latent_values:
            return self.k[row, :end], self.k[row, :end, :, : self.latent_values]
        if v is None:
            raise ModelError("this KV cache stores values: append needs v")
        self.v[row, self.length : end] = v
        return self.k[row, :end], self.v[row, :end]

    def holds_keys(self, layer: int) -> bool:
        """Whether `layer`'s keys and values are stored here whole: a full layer of a key-value
        cache (not a sliding one's ring, a latent cache or a recurrent layer)."""
        return not self.latent_values and self.windows[layer] <= 0 and layer in self._row

    def decode_slot(self, layer: int, ahead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Full layer `layer`'s key and value storage [capacity, kv, d], with room for
        `ahead` + 1 more positions: a kernel writes the new key and value at `length` (+
        `ahead`: a speculative pass's later rows) itself and reads every position up to it
        (`kvq.model.decode_attention`)."""
        if not self.holds_keys(layer):
            raise ModelError(f"layer {layer} is not a full layer of a key-value cache")
        self.check_room(ahead + 1)  # the kernel writes at `length`: never past the storage
        self._reserve(self.length + ahead + 1)
        row = self._row[layer]
        return self.k[row], self.v[row]

    def append_window(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store k, v ([T, kv, d]) of sliding layer `layer` after `length`; return the keys
        and values a pass of those T queries reads, [S, kv, d] in position order, and the
        position of the first (S = T + up to window - 1 earlier positions)."""
        t, start = k.shape[0], self.length
        first = max(0, start - self.window + 1)  # the oldest position a new query sees
        self._reserve_ring(start - first + t)
        cap, row = int(self.wk.shape[1]), self._row[layer]
        slots = torch.arange(start, start + t, device=k.device) % cap  # [T]
        self.wk[row, slots], self.wv[row, slots] = k, v
        read = torch.arange(first, start + t, device=k.device) % cap  # [S]
        return self.wk[row, read], self.wv[row, read], first

    def _reserve_ring(self, need: int) -> None:
        """Grow the sliding layers' ring to `need` slots, each position kept in its slot."""
        cap = int(self.wk.shape[1])
        if need <= cap:
            return
        new_cap = min(self.max_len, max(need, 2 * cap))
        keep = torch.arange(max(0, self.length - cap), self.length)  # the positions held
        for name in ("wk", "wv"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], new_cap, *old.shape[2:]))
            new[:, keep % new_cap] = old[:, keep % cap]
            setattr(self, name, new)

    def begin(self) -> None:
        """Start a pass: drop any recurrent state a failed pass staged."""
        if self.state is not None:
            self.state.discard()

    def advance(self, n: int) -> None:
        """Mark `n` more positions as stored (after every layer has appended them) and
        commit the recurrent state the pass staged. A speculative pass (`SeqStep.verify`)
        commits only its accepted rows: `n` may be fewer than the pass wrote, and the
        positions past `length` are overwritten by the next pass."""
        self.check_room(n)
        self.length += n
        if self.state is not None:
            self.state.commit(n)


@dataclass
class SeqStep:
    """New tokens of one sequence for one forward pass (many for prefill, one for decode)."""

    tokens: list[int]
    cache: KVCache
    # a speculative pass: every row computed as a decode step would compute it, logits at
    # every row, and the caller commits only the accepted rows (`kvq.model.speculative`)
    verify: bool = False
