"""The layer pattern of Llama-4 files (`llama4`), read as llama.cpp reads it.

- MoE layers: `interleave_moe_layer_step` n (required): layer i is MoE when `(i + 1) % n == 0`.
- Chunked attention: unless the file says `attention.sliding_window = 0`, the layers
  `i % p < p - 1` (`attention.sliding_window_pattern` p, default 4, or one flag per layer)
  attend within chunks of `CHUNK` positions (query p sees keys `floor(p / CHUNK) * CHUNK ..
  p`). llama.cpp fixes the chunk at 8192 whatever the file says; so does kvq.
- NoPE: layer i runs without rope when `(i + 1) % NO_ROPE_STEP == 0` (every 4th layer,
  llama.cpp's `n_no_rope_layer_step`, not a file key); with no chunks, only the last layer.
- Temperature tuning, on the NoPE layers of a chunked file: q times
  `1 + TEMP_SCALE ln(floor((p + 1) / TEMP_FLOOR) + 1)`.
- q/k norm: an unweighted RMS norm of q and k after rope, on the rope layers, unless the
  model has 128 experts (llama.cpp's `use_kq_norm`: off for Maverick).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from kvq.errors import ModelError
from kvq.gguf import reader as gio

CHUNK = 8192  # llama.cpp's n_swa for llama4's chunked layers
CHUNK_PATTERN = 4  # 3 chunked layers, then 1 full
NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step default
TEMP_FLOOR = 8192  # llama.cpp's n_attn_temp_floor_scale
TEMP_SCALE = 0.1  # llama.cpp's f_attn_temp_scale
NO_KQ_NORM_EXPERTS = 128  # Maverick (17B-128E) runs without the q/k norm


def layer_pattern(
    reader: GGUFReader, a: str, blocks: int, default: int
) -> tuple[int, tuple[bool, ...]]:
    """`attention.sliding_window_pattern` as (period, ()) or, where the file gives one flag
    per layer, (0, flags)."""
    key = f"{a}.attention.sliding_window_pattern"
    given = gio.field(reader, key, None, required=False)
    if isinstance(given, list):  # one flag per layer, as llama.cpp also reads it
        if len(given) != blocks or not all(isinstance(b, bool | int) for b in given):
            raise ModelError(
                f"{key} is an array of {len(given)} items; a per-layer pattern "
                f"needs one flag for each of the {blocks} layers"
            )
        return 0, tuple(bool(b) for b in given)
    pattern = gio.int_field(reader, key, default)
    if pattern < 0:
        raise ModelError(f"{key} = {pattern} must not be negative")
    return pattern, ()


def llama4_fields(reader: GGUFReader, a: str, blocks: int, experts: int) -> dict[str, Any]:
    """The ModelMeta fields of a llama4 file's layer pattern (see the module's docstring)."""
    step = gio.int_field(reader, f"{a}.interleave_moe_layer_step")
    if not 1 <= step <= blocks:
        raise ModelError(
            f"{a}.interleave_moe_layer_step = {step} must be in 1..{blocks} (block_count): "
            "kvq serves models with at least one MoE layer"
        )
    out: dict[str, Any] = {"moe_layer_step": step, "kq_norm": experts != NO_KQ_NORM_EXPERTS}
    if gio.int_field(reader, f"{a}.attention.sliding_window", -1) == 0:
        return out | {"no_rope_step": blocks}  # no chunks: llama.cpp ropes all but the last
    pattern, flags = layer_pattern(reader, a, blocks, CHUNK_PATTERN)
    return out | {
        "sliding_window": CHUNK,
        "sliding_window_pattern": pattern,
        "sliding_layers": flags,
        "swa_chunked": True,
        "rope_freq_base_swa": gio.float_field(reader, f"{a}.rope.freq_base_swa", 0.0),
        "no_rope_step": NO_ROPE_STEP,
        "attn_temp_floor": TEMP_FLOOR,
        "attn_temp_scale": TEMP_SCALE,
    }
