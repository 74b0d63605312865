"""What differs between the MoE architectures kvq serves, as llama.cpp runs them.

| GGUF arch  | models                 | attention                        | RoPE  | top-k weights     |
|------------|------------------------|----------------------------------|-------|-------------------|
| `qwen3moe` | Qwen3-30B-A3B, 235B    | per-head RMSNorm of q and k      | NEOX  | renormalised      |
| `qwen2moe` | Qwen1.5-MoE, Qwen2-57B | q/k/v biases                     | NEOX  | as softmax gives  |
| `llama`    | Mixtral 8x7B, 8x22B    | plain (Q/K rows permuted, below) | NORM  | renormalised      |

`qwen2moe` adds a shared expert to every token: `sigmoid(x . w_gate) * ffn_shexp(x)`.
`llama` is Mixtral only when `llama.expert_count > 0` (a dense llama is refused). llama.cpp's
converter permutes the rows of Q and K of `llama` files so that its NORM rope (adjacent pairs)
equals Hugging Face's rotate-half rope; kvq reads them as they are and runs NORM rope.
A GGUF may override the top-k renormalisation with `<arch>.expert_weights_norm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvq.errors import ModelError


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """The architecture-dependent parts of a forward pass."""

    name: str  # `general.architecture` in the GGUF
    rope_style: str  # "neox": pairs (i, i + d/2); "norm": adjacent pairs (2i, 2i + 1)
    qk_norm: bool  # attn_{q,k}_norm: RMSNorm over each head before RoPE
    qkv_bias: bool  # attn_{q,k,v}.bias are part of the arch (optional on the others)
    shared_expert: bool  # ffn_{gate,up,down}_shexp + ffn_gate_inp_shexp
    norm_topk: bool  # renormalise the top-k softmax weights to sum 1 (llama.cpp's norm_w)


ARCHS: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec("qwen3moe", "neox", True, False, False, True),
    "qwen2moe": ArchSpec("qwen2moe", "neox", False, True, True, False),
    "llama": ArchSpec("llama", "norm", False, False, False, True),
}

# names accepted by `make_tiny(arch=...)` and `kvq model make-tiny --arch`
TINY_ARCHS: dict[str, str] = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "mixtral": "llama"}

SUPPORTED_TEXT = "qwen3moe, qwen2moe, llama with llama.expert_count > 0 (Mixtral)"


def arch_spec(arch: str) -> ArchSpec:
    """The spec of GGUF architecture `arch`, or ModelError naming what kvq serves."""
    spec = ARCHS.get(arch)
    if spec is None:
        raise ModelError(
            f"model architecture {arch!r} is not supported; kvq serves {SUPPORTED_TEXT}"
        )
    return spec


def tiny_arch(name: str) -> ArchSpec:
    """The spec behind a `make_tiny` arch name (`mixtral` is GGUF arch `llama`)."""
    arch = TINY_ARCHS.get(name)
    if arch is None:
        raise ModelError(f"make_tiny arch {name!r} is unknown; choose one of {sorted(TINY_ARCHS)}")
    return ARCHS[arch]


def permute_qk(w: npt.NDArray[np.float32], n_head: int) -> npt.NDArray[np.float32]:
    """llama.cpp's converter permutation of Q/K rows for `llama` (pass kv heads for K).

    w: [n_head * d, ...] in Hugging Face order -> the same shape in GGUF order.
    """
    d2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
