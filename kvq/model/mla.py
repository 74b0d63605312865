"""DeepSeek's multi-head latent attention (MLA): what it caches and how it scales.

Per token, MLA compresses K and V into one latent `c_kv` of `kv_lora_rank` (r) values plus a
single rope key `k_pe` of `rope` values shared by all heads: 576 values a token a layer for
DeepSeek-V3 (r = 512, rope = 64), against 40,960 for per-head K and V of its 128 heads. Head h's
key is `[W_k[h] c_kv ; k_pe]` and its value `W_v[h] c_kv` (`attn_k_b`, `attn_v_b`). kvq computes
attention in the absorbed form, as llama.cpp does, so that only the latent is ever cached:

    q_nope . (W_k[h] c) = (W_k[h]^T q_nope) . c     (the query taken into the latent space)
    out[h] = W_v[h] (sum_s p_s c_s)                  (values: the latent itself, then W_v)

so every head attends over the same cached `[c ; k_pe]` rows (MQA with r + rope wide keys
and r wide values), and the per-head up-projections run once per new token, not per cached one.

YaRN: DeepSeek's checkpoints scale the attention logits by `mscale^2 / sqrt(nope + rope)`
with `mscale = 1 + 0.1 * mscale_all_dim * ln(factor)`, and leave cos/sin unscaled; GGUF files
carry `0.1 * mscale_all_dim` as `rope.scaling.yarn_log_multiplier`. Without that key, llama.cpp
scales cos/sin by YaRN's usual `1 + 0.1 ln(factor)` and the logits by its square.
"""

from __future__ import annotations

import math

from kvq.catalog import ModelMeta


def mla_scales(meta: ModelMeta) -> tuple[float | None, float]:
    """(cos/sin scale for the rope, attention logit scale) of an MLA model; for the other
    attention kinds `(None, 0.0)`: the rope's own YaRN scale and 1/sqrt(head size)."""
    if not meta.kv_lora_rank:
        return None, 0.0
    factor = meta.rope_scaling_factor
    rope_scale, mscale = 1.0, 1.0
    if meta.rope_scaling_type == "yarn" and factor > 1.0:
        mscale_all = meta.rope_yarn_log_mul / 0.1
        rope_scale = 1.0 if mscale_all else 1.0 + 0.1 * math.log(factor)
        mscale = rope_scale * (1.0 + 0.1 * mscale_all * math.log(factor))
    return rope_scale, mscale * mscale / math.sqrt(meta.head_dim)
