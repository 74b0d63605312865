"""The MoE architectures kvq serves, each declared from parts, as llama.cpp runs them.

A family is one `ArchSpec`: its attention kind, how q and k are normalised, its rope, its router,
its shared expert and its layer pattern. The forward pass (`kvq.model.backbone`) and the loader
(`kvq.model.loader`) read the parts, never the family's name; adding a family is one entry in
`ARCHS` plus any new block. Hyper-parameters (sizes, the leading dense layers, the gating
function, expert groups, YaRN) come from the file (`kvq.gguf.meta`).

| GGUF arch   | models                        | attention                    | q/k norm | rope  | router                         | shared expert | layers           |
|-------------|-------------------------------|------------------------------|----------|-------|--------------------------------|---------------|------------------|
| `qwen3moe`  | Qwen3-30B-A3B, 235B           | GQA                          | per head | NEOX  | softmax, renormalised          | -             | all MoE          |
| `qwen2moe`  | Qwen1.5-MoE, Qwen2-57B        | GQA, q/k/v biases            | -        | NEOX  | softmax                        | sigmoid-gated | all MoE          |
| `llama`     | Mixtral 8x7B, 8x22B           | GQA (Q/K rows permuted)      | -        | NORM  | softmax, renormalised          | -             | all MoE          |
| `olmoe`     | OLMoE-1B-7B                   | MHA                          | whole q/k| NEOX  | softmax                        | -             | all MoE          |
| `glm4moe`   | GLM-4.5, 4.5-Air, 4.6         | GQA, q/k/v biases, partial rope | per head if present | NEOX | sigmoid + bias, renormalised | plain    | leading dense, MTP layer skipped |
| `deepseek2` | DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2 | MLA, latent KV cache    | (q LoRA, kv latent norms) | NORM | softmax (V2) or sigmoid + bias (V3), groups | plain | leading dense |
| `gpt-oss`   | gpt-oss-20b, 120b             | GQA, q/k/v/o biases, sinks, sliding window on even layers | - | NEOX | router bias, softmax over the top-k logits | - | all MoE, clamped SwiGLU experts with biases |
| `qwen35moe` | Qwen3.5 MoE (35B-A3B, 122B-A10B, 397B-A17B) | Gated DeltaNet on 3 of 4 layers, gated-q GQA on every `full_attention_interval`-th | per head (GQA layers) | NEOX (IMROPE, text), partial | softmax, renormalised | sigmoid-gated | all MoE |
| `llama4`    | Llama-4 Scout, Maverick       | GQA, chunked on 3 of 4 layers, NoPE on every 4th | unweighted RMS on rope layers | NORM, rope_freqs | top-k logits, sigmoid weight scales the input | plain | every `interleave_moe_layer_step`-th MoE |

`qwen2moe`'s shared expert is gated per token: `sigmoid(x . w_gate) * ffn_shexp(x)`; the
`plain` shared experts of `glm4moe` and `deepseek2` are added as they are. `llama` is Mixtral
only when `llama.expert_count > 0` (a dense llama is refused). llama.cpp's converter permutes
the rows of Q and K of `llama` files so that its NORM rope (adjacent pairs) equals Hugging
Face's rotate-half rope; kvq reads them as they are and runs NORM rope. `deepseek2`'s NORM rope
on unpermuted rows is DeepSeek's own interleaved rope. A GGUF may override the top-k
renormalisation with `<arch>.expert_weights_norm` and the gating with `expert_gating_func`.

`gpt-oss` (llama.cpp's `openai-moe`): every attention has a learnt sink logit per head
(`attn_sinks`) that joins the softmax without a value; layers `i % pattern < pattern - 1`
(pattern `attention.sliding_window_pattern`, default 2: the even layers) see only the last
`attention.sliding_window` positions; the router adds `ffn_gate_inp.bias` to its logits,
picks the top-k logits and softmaxes those (llama.cpp's SOFTMAX_WEIGHT gating); the experts
add `ffn_{gate,up,down}_exps.bias` and use OpenAI's clamped SwiGLU (`EXPERT_ACTS`).

`qwen35moe` (Qwen3.5): layer i is linear attention where the file's
`attention.recurrent_layers` says so, or, without that array, unless
`(i + 1) % full_attention_interval == 0` (default 4): Gated DeltaNet (`kvq.model.deltanet`:
no KV cache, a fixed-size recurrent state per sequence beside it, sizes from `ssm.*`). Its full
attention projects q and an output gate together (`attn_q` is `[heads * 2d, H]`, per head q
then gate) and multiplies the attention output by `sigmoid(gate)` before `attn_output`. Its
IMROPE gives a text token its position in the t, h and w sections and 0 in e (`Rope`), which
is NEOX rope over `rope.dimension_count` with the e pairs unrotated.

`llama4` (Llama-4, `kvq.gguf.meta` reads its layer pattern): layer i is MoE when
`(i + 1) % interleave_moe_layer_step == 0`, dense otherwise; every 4th layer
(`(i + 1) % 4 == 0`, llama.cpp's `n_no_rope_layer_step`) has no rope (NoPE) and full
attention, and on the NoPE layers q is scaled by the attention temperature
`1 + 0.1 ln(floor((p + 1) / 8192) + 1)`; the others rope q and k (with the file's
`rope_freqs` factors), then RMS-normalise them without a weight (unless the model has 128
experts: Maverick) and attend within their chunk of 8192 positions (query p sees keys
`floor(p / 8192) * 8192 .. p`). A file with `attention.sliding_window = 0` has no chunks and
ropes every layer but the last. The router takes the top-k logits; each chosen expert reads
its input times `sigmoid(logit)` (`ArchSpec.scale_input`), and the shared expert (as wide
as one expert) is added as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvq.errors import ModelError

# attention kinds
GQA = "gqa"  # grouped-query attention with per-head K and V in the cache
MLA = "mla"  # DeepSeek's multi-head latent attention: the cache holds the compressed latent

# q/k normalisation kinds
QK_NONE = "none"  # none (a per-head attn_{q,k}_norm is still applied where the file has one)
QK_HEAD = "head"  # RMSNorm over each head before rope (qwen3moe); required
QK_FULL = "full"  # RMSNorm over the whole q and k projections (olmoe); required

# shared expert kinds
SHARED_NONE = "none"
SHARED_GATED = "gated"  # qwen2moe: sigmoid(x . ffn_gate_inp_shexp) * swiglu(x)
SHARED_PLAIN = "plain"  # glm4moe, deepseek2: swiglu(x) added as it is

# the routed experts' activation: silu(g) * u, or gpt-oss's clamped form (`kvq.model.experts`)
ACT_SILU = "silu"
ACT_SWIGLU_OAI = "swiglu_oai"
EXPERT_ACTS = (ACT_SILU, ACT_SWIGLU_OAI)


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """The architecture-dependent parts of a forward pass."""

    name: str  # `general.architecture` in the GGUF
    attention: str = GQA  # GQA | MLA
    rope_style: str = "neox"  # "neox": pairs (i, i + d/2); "norm": adjacent pairs (2i, 2i + 1)
    qk_norm: str = QK_NONE  # QK_NONE | QK_HEAD | QK_FULL
    qkv_bias: bool = False  # attn_{q,k,v}.bias are part of the arch (optional on the others)
    shared: str = SHARED_NONE  # SHARED_NONE | SHARED_GATED | SHARED_PLAIN
    norm_topk: bool = (
        True  # renormalise the top-k weights (llama.cpp's norm_w), unless the file says
    )
    gating: str = "softmax"  # the router's default scores, unless `expert_gating_func` says
    ffn_norm: str = (
        "ffn_norm"  # the tensor normalising the FFN input (glm4moe: post_attention_norm)
    )
    dense_lead: bool = False  # reads `leading_dense_block_count` (dense FFN layers first)
    partial_rope: bool = False  # rope.dimension_count may be below the head size
    hf_permuted_qk: bool = False  # the converter permuted Q/K rows (llama: `permute_qk`)
    out_bias: bool = False  # attn_output.bias
    attn_sinks: bool = False  # attn_sinks.weight: a sink logit per head in the softmax
    swa_pattern: int = 0  # > 0: layers i % p < p - 1 slide (file: sliding_window[_pattern])
    router_bias: bool = False  # ffn_gate_inp.bias added to the router's logits
    expert_bias: bool = False  # ffn_{gate,up,down}_exps.bias, stacked like the experts
    expert_act: str = ACT_SILU  # ACT_SILU | ACT_SWIGLU_OAI
    linear_attn: bool = False  # Gated DeltaNet layers between full ones (full_attention_interval)
    gated_q: bool = False  # attn_q also projects a per-head output gate (sigmoid) (qwen35moe)
    imrope: bool = False  # interleaved multi-section rope (rope.dimension_sections) (qwen35moe)
    moe_step: bool = False  # reads `interleave_moe_layer_step`: every n-th layer MoE (llama4)
    chunked: bool = False  # llama4's chunked attention, NoPE layers, temperature tuning, kq norm
    choose_logits: bool = False  # the top-k is taken on the router's logits (llama4)
    scale_input: bool = False  # a chosen expert reads x * weight, its output unweighted (llama4)
    rope_freqs: bool = False  # rope_freqs.weight: llama3-style frequency factors, if present

    @property
    def shared_expert(self) -> bool:
        return self.shared != SHARED_NONE


ARCHS: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec("qwen3moe", qk_norm=QK_HEAD),
    "qwen2moe": ArchSpec("qwen2moe", qkv_bias=True, shared=SHARED_GATED, norm_topk=False),
    "llama": ArchSpec("llama", rope_style="norm", hf_permuted_qk=True),
    "olmoe": ArchSpec("olmoe", qk_norm=QK_FULL, norm_topk=False),
    "glm4moe": ArchSpec(
        "glm4moe",
        qkv_bias=True,
        shared=SHARED_PLAIN,
        norm_topk=False,
        gating="sigmoid",
        ffn_norm="post_attention_norm",
        dense_lead=True,
        partial_rope=True,
    ),
    "deepseek2": ArchSpec(
        "deepseek2",
        attention=MLA,
        rope_style="norm",
        shared=SHARED_PLAIN,
        norm_topk=False,
        dense_lead=True,
        partial_rope=True,
    ),
    "gpt-oss": ArchSpec(
        "gpt-oss",
        qkv_bias=True,
        out_bias=True,
        attn_sinks=True,
        swa_pattern=2,
        router_bias=True,
        expert_bias=True,
        expert_act=ACT_SWIGLU_OAI,
        norm_topk=False,
        gating="softmax_weight",
        ffn_norm="post_attention_norm",
    ),
    "qwen35moe": ArchSpec(
        "qwen35moe",
        qk_norm=QK_HEAD,
        shared=SHARED_GATED,
        ffn_norm="post_attention_norm",
        partial_rope=True,
        linear_attn=True,
        gated_q=True,
        imrope=True,
    ),
    "llama4": ArchSpec(
        "llama4",
        rope_style="norm",
        shared=SHARED_PLAIN,
        norm_topk=False,
        gating="sigmoid",
        moe_step=True,
        chunked=True,
        choose_logits=True,
        scale_input=True,
        rope_freqs=True,
    ),
}

# names accepted by `make_tiny(arch=...)` and `kvq model make-tiny --arch`
TINY_ARCHS: dict[str, str] = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
    "glm4moe": "glm4moe",
    "deepseek2": "deepseek2",
    "gpt-oss": "gpt-oss",
    "qwen35moe": "qwen35moe",
    "llama4": "llama4",
}

SUPPORTED_TEXT = (
    "qwen3moe, qwen2moe, olmoe, glm4moe, deepseek2, llama with llama.expert_count > 0 "
    "(Mixtral), gpt-oss, qwen35moe, llama4"
)


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
