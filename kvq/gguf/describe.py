"""A plain-dict description of a GGUF model: hyper-parameters, quant types, slice table, sizes
and the memory each kvq role needs to serve it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.gguf.arch import arch_spec
from kvq.gguf.layout import slice_nbytes
from kvq.gguf.meta import read_meta
from kvq.quant import kernels
from kvq.slices import slice_grid

_LAYER = re.compile(r"^blk\.\d+\.")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class MemoryAssumptions:
    """What the memory estimate assumes: compute dtype, sequences, KV positions (0: context)."""

    dtype: str = "float32"  # the coordinator's compute dtype (float32 on CPU)
    n_slots: int = 4  # sequences with a KV cache (KVQ_N_SLOTS)
    kv_positions: int = 0  # positions per sequence; 0 = the model's whole context


def describe_model(
    path: str | Path, slice_experts: int = 4, memory: MemoryAssumptions | None = None
) -> dict[str, Any]:
    """Everything `kvq model inspect` shows; `slices` cuts each layer into `slice_experts`."""
    if slice_experts < 1:
        raise ModelError(f"slice_experts {slice_experts} must be >= 1")
    meta = read_meta(path)
    spec = arch_spec(meta.arch)
    out: dict[str, Any] = {"path": str(path)}
    out.update({f.name: getattr(meta, f.name) for f in fields(meta) if f.name != "expert_tensors"})
    out.update(
        attention=spec.attention,
        rope_style=spec.rope_style,
        qk_norm=spec.qk_norm,
        shared_expert=spec.shared_expert,
        routed_experts="present" if meta.holds_experts else "absent (a backbone file)",
    )
    reader = gio.open_reader(path)
    out["quant_types"] = quant_types(reader)
    out["slice_experts"] = slice_experts
    out["slices"] = slice_table(meta, slice_experts)
    out.update(tensor_sizes(reader, meta))
    out["memory"] = memory_needs(reader, meta, out["slices"], memory or MemoryAssumptions())
    return out


def quant_types(reader: GGUFReader) -> dict[str, dict[str, int]]:
    """Per tensor kind (name without `blk.N.`), how many tensors use each ggml type."""
    kinds: dict[str, Counter[str]] = {}
    for t in reader.tensors:
        kind = _LAYER.sub("", t.name).removesuffix(".weight")
        kinds.setdefault(kind, Counter())[gio.quant_type(int(t.tensor_type)).name] += 1
    return {k: dict(sorted(c.items())) for k, c in sorted(kinds.items())}


def slice_table(meta: ModelMeta, slice_experts: int) -> list[dict[str, int]]:
    """Every (layer, expert range) slice at expert grain, with its download size in bytes
    (none in a backbone file: its experts are in the full file only)."""
    if not meta.holds_experts:
        return []
    return [
        {
            "layer": b.layer_start,
            "expert_start": b.expert_start,
            "expert_end": b.expert_end,
            "bytes": slice_nbytes(meta, b.layer_start, b.expert_start, b.expert_end),
        }
        for b in slice_grid(
            meta.block_count,
            meta.expert_count,
            1,
            slice_experts,
            meta.moe_layers.start,
            meta.moe_layers.step,
        )
    ]


def tensor_sizes(reader: GGUFReader, meta: ModelMeta) -> dict[str, int]:
    """Encoded bytes of the routed experts, of everything else (the backbone), and of both."""
    experts = _expert_names(meta)
    nbytes = Counter[str]()
    for t in reader.tensors:
        nbytes["expert" if t.name in experts else "backbone"] += int(t.n_bytes)
    return {
        "expert_bytes": nbytes["expert"],
        "backbone_bytes": nbytes["backbone"],
        "tensor_bytes": nbytes["expert"] + nbytes["backbone"],
    }


def memory_needs(
    reader: GGUFReader, meta: ModelMeta, slices: list[dict[str, int]], a: MemoryAssumptions
) -> dict[str, Any]:
    """Bytes each role holds: the coordinator with KVQ_COORDINATOR_EXPERTS=all and =none, and
    a worker per slice. See `assumptions` in the result for what is counted."""
    if a.dtype not in DTYPE_BYTES or a.n_slots < 1 or a.kv_positions < 0:
        raise ModelError(
            f"memory assumptions {a} are invalid: dtype one of {sorted(DTYPE_BYTES)}, "
            "n_slots >= 1, kv_positions >= 0"
        )
    dense, mapped = _backbone_bytes(reader, meta, a)
    positions = a.kv_positions or meta.context_length
    kv = _kv_cache_bytes(meta, a, positions)
    expert_bytes = tensor_sizes(reader, meta)["expert_bytes"]
    backbone = dense + mapped
    per_slice = [s["bytes"] for s in slices] or [0]
    return {
        "dtype": a.dtype,
        "n_slots": a.n_slots,
        "kv_positions": positions,
        "backbone_bytes": backbone,
        "backbone_dense_bytes": dense,
        "backbone_mapped_bytes": mapped,
        "kv_cache_bytes": kv,
        "coordinator_all_bytes": backbone + kv + expert_bytes,
        "coordinator_none_bytes": backbone + kv,
        "worker_slice_bytes_max": max(per_slice),
        "worker_slice_bytes_min": min(per_slice),
        "assumptions": _memory_assumptions(meta, a, positions),
    }


def _backbone_bytes(reader: GGUFReader, meta: ModelMeta, a: MemoryAssumptions) -> tuple[int, int]:
    """(dense, mapped): bytes of the backbone dequantized to `a.dtype`, and kept encoded."""
    experts, size = _expert_names(meta), DTYPE_BYTES[a.dtype]
    dense = mapped = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" or (t.name not in experts and _kept_encoded(t, a)):
            mapped += int(t.n_bytes)
        elif t.name not in experts:
            dense += int(t.n_elements) * size
    return dense, mapped


def _kv_cache_bytes(meta: ModelMeta, a: MemoryAssumptions, positions: int) -> int:
    """The full KV cache of `a.n_slots` sequences, plus the recurrent layers' state."""
    size = DTYPE_BYTES[a.dtype]
    heads, width = meta.cache_width
    per_token = heads * width * (1 if meta.kv_lora_rank else 2)  # MLA: the latent, once
    rec = meta.recurrent_layers  # Gated DeltaNet: no K/V, a fixed-size state per sequence
    kv_layers = meta.block_count - len(rec)
    kv = a.n_slots * positions * kv_layers * per_token * size
    if rec:
        d = meta.ssm_state_size
        channels = (2 * meta.ssm_group_count + meta.ssm_time_step_rank) * d
        state = (meta.ssm_conv_kernel - 1) * channels + meta.ssm_time_step_rank * d * d
        kv += a.n_slots * len(rec) * state * size
    return kv


def _memory_assumptions(meta: ModelMeta, a: MemoryAssumptions, positions: int) -> list[str]:
    """What `memory_needs` counts, in words, for the result's `assumptions`."""
    rec = meta.recurrent_layers
    kv_layers = meta.block_count - len(rec)
    return [
        f"backbone: dense = vectors, norms, routers and weight matrices of types without "
        f"a fused kernel, dequantized to {a.dtype} once at load (anonymous memory); "
        "mapped = token_embd (rows dequantized on use) and, in float32, the weight "
        "matrices of kernel types ("
        + ", ".join(q.name for q in kernels.KERNEL_TYPES)
        + "), computed encoded from the memory-mapped file (page cache)",
        f"KV cache: {a.n_slots} sequences x {positions} positions x {kv_layers} "
        + (
            f"layers x one MLA latent of {meta.cache_width[1]} values in {a.dtype} "
            if meta.kv_lora_rank
            else f"layers x K and V x {meta.head_count_kv} KV heads x {meta.head_dim} in {a.dtype} "
        )
        + "(the cache grows by doubling, so this is its full size)"
        + (
            f"; + per sequence the recurrent state of {len(rec)} Gated DeltaNet layers "
            "(conv inputs and one state matrix per value head)"
            if rec
            else ""
        ),
        "all: + every routed expert at its encoded size (memory-mapped from the file); "
        "none: experts on workers only (a coordinator that still maps them for fallback "
        "pays page cache, not its own memory)",
        "worker: the encoded bytes of its slice; activations and scratch not counted",
    ]


def _kept_encoded(t: ReaderTensor, a: MemoryAssumptions) -> bool:
    """Whether the backbone keeps non-expert tensor `t` encoded and mapped: a weight matrix
    (not a router) of a type a fused kernel computes, in float32 (`Loader.matrix`)."""
    matrix = len(t.shape) == 2 and min(int(d) for d in t.shape) > 1
    return (
        matrix
        and "ffn_gate_inp" not in t.name
        and a.dtype == "float32"
        and int(t.tensor_type) in kernels.KERNEL_TYPES
    )


def _expert_names(meta: ModelMeta) -> set[str]:
    return {r.name for kinds in meta.expert_tensors.values() for r in kinds.values()}
