"""Real-sized synthetic MoE models (`make-tiny --preset`), written by streaming random blocks.

- `olmoe-1b-7b`: OLMoE-1B-7B's sizes (16 layers, 64 experts, top-8, hidden 2048, expert FFN
  1024, 16 heads and 16 KV heads of 128, vocab 50304, context 4096) in `qwen3moe` tensors,
  since kvq runs qwen3moe, not llama.cpp's `olmoe`. Two differences from OLMoE: q/k RMSNorm
  is per head (`attn_q_norm` [128]) instead of over the whole projection [2048], and the
  top-k weights are renormalised (OLMoE's are not). Every tensor size is OLMoE's otherwise.
- `small`: 8 layers, 32 experts, top-4, hidden 1024, expert FFN 512, 8 heads / 4 KV heads of
  128, vocab 32000, context 4096 (Q4_K_M: about 0.2 GB). Not a real model: the README's, big
  enough that an expert call costs more than a round trip to a worker on the same machine.
- `deepseek-v2-lite`: DeepSeek-V2-Lite (arch `deepseek2`: 27 layers, the first dense with FFN
  10944; 64 routed experts top-6 of FFN 1408 plus 2 shared; MLA with no q LoRA, kv_lora_rank
  512, heads of 128 + 64 rope, values of 128, 16 heads; hidden 2048, vocab 102400; softmax
  routing without groups or renormalisation; YaRN x40 over 4096 positions, mscale_all_dim
  0.707), context 32768 here (the real one: 163840). About 15.7 B parameters.
- `qwen3-30b-a3b`: Qwen3-30B-A3B (48 layers, 128 experts, top-8, hidden 2048, expert FFN 768,
  32 heads / 4 KV heads of 128, vocab 151936, context 40960), arch `qwen3moe`.
- `gpt-oss-20b`: gpt-oss-20b (arch `gpt-oss`: 24 layers, 32 experts top-4, hidden 2880,
  expert FFN 2880, 64 heads / 8 KV heads of 64, a sink per head, a 128-position window on the
  even layers, biases on q/k/v/o, the router and every expert matrix; vocab 201088; rope base
  150000 with YaRN x32 over 4096 positions, as its converter writes it: no log multiplier),
  context 131072. Its widths are not multiples of 256, so it has no K-quant: its default is
  the `mxfp4` mix of the real files (MXFP4 experts, Q8_0 elsewhere: about 12 GB).

Weights are valid random blocks of each tensor's type (`kvq.tools.synth.quants.random_blocks`), not
quantized floats: rms 1/sqrt(fan-in) for input projections and `_OUT`/sqrt(fan-in) for
`attn_output` and `ffn_down*`, so the residual stream grows slowly through the layers; norms
F32 near 1. The router is skewed: the first `_shared_width` columns of every token embedding
row hold the same constant block, so hidden states lean along that direction `u`, and router
row e of each layer gets `zipf[e] * u` (Zipf over a per-layer random expert order, scaled up
with depth as the residual grows): a few experts per layer win most tokens.

The file is streamed: tensor infos first, then each tensor generated and written in turn (the
next one generated in a thread while the current one is written), so memory stays at about
two tensors (Qwen3's largest, `output.weight`, is 255 MB at Q6_K).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType

from kvq.errors import ModelError
from kvq.gguf.arch import ArchSpec, arch_spec
from kvq.tools.synth import bpe
from kvq.tools.synth.quants import U8, check_quant, encode, random_blocks, tensor_type
from kvq.tools.synth.tiny import add_metadata
from kvq.tools.synth.tiny_weights import TinyConfig, layer_shapes

Q = GGMLQuantizationType
_OUT = 0.25  # rms of attn_output / ffn_down relative to 1/sqrt(fan-in)
_SKEW = 4.0  # router logit bias of each layer's most popular expert (noise logits ~ N(0, 1))
_LOGITS = 2.0  # rms of the output logits for a unit-rms hidden state


@dataclass(frozen=True, slots=True)
class Preset:
    """A model shape to write with random weights."""

    name: str
    cfg: TinyConfig
    context: int
    rope_base: float
    rms_eps: float
    arch: str = "qwen3moe"  # a GGUF arch kvq runs
    # (factor, original context, log multiplier; 0: the key is not written)
    yarn: tuple[float, int, float] | None = None
    quant: str = "q4_k_m"  # the default type or mix (`make-tiny --preset` without --quant)


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor of a preset file: GGUF name, numpy shape, ggml type, bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    nbytes: int


PRESETS: dict[str, Preset] = {
    "small": Preset(
        "small",
        TinyConfig(8, 32, 4, 1024, 512, 8, 4, 128, vocab=32000),
        context=4096,
        rope_base=10000.0,
        rms_eps=1e-6,
    ),
    "olmoe-1b-7b": Preset(
        "olmoe-1b-7b",
        TinyConfig(16, 64, 8, 2048, 1024, 16, 16, 128, vocab=50304),
        context=4096,
        rope_base=10000.0,
        rms_eps=1e-5,
    ),
    "deepseek-v2-lite": Preset(
        "deepseek-v2-lite",
        TinyConfig(
            27,
            64,
            6,
            2048,
            1408,
            16,
            16,
            192,
            vocab=102400,
            dense_layers=1,
            dense_ffn=10944,
            shared_count=2,
            rope_dim=64,
            kv_lora_rank=512,
            v_head_dim=128,
            gating="softmax",
            weights_norm=False,
            weights_scale=1.0,
        ),
        context=32768,
        rope_base=10000.0,
        rms_eps=1e-6,
        arch="deepseek2",
        yarn=(40.0, 4096, 0.0707),
    ),
    "qwen3-30b-a3b": Preset(
        "qwen3-30b-a3b",
        TinyConfig(48, 128, 8, 2048, 768, 32, 4, 128, vocab=151936),
        context=40960,
        rope_base=1e6,
        rms_eps=1e-6,
    ),
    "gpt-oss-20b": Preset(
        "gpt-oss-20b",
        TinyConfig(24, 32, 4, 2880, 2880, 64, 8, 64, vocab=201088, sliding_window=128),
        context=131072,
        rope_base=150000.0,
        rms_eps=1e-5,
        arch="gpt-oss",
        yarn=(32.0, 4096, 0.0),
        quant="mxfp4",
    ),
}


def preset_named(name: str) -> Preset:
    """The preset called `name`, or ModelError listing them."""
    if name not in PRESETS:
        raise ModelError(f"preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def plan(p: Preset, quant: str = "q4_k_m") -> list[PlannedTensor]:
    """Every tensor of the file, in file order, with its type and size (nothing is written)."""
    out = []
    for name, shape in tensor_shapes(p.cfg, arch_spec(p.arch)).items():
        qtype = tensor_type(name, shape, quant, p.cfg.layers, p.cfg.experts)
        block, size = GGML_QUANT_SIZES[qtype]
        out.append(PlannedTensor(name, shape, qtype, int(np.prod(shape)) // block * size))
    return out


def tensor_shapes(cfg: TinyConfig, spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of every tensor, in the order `tiny_tensors` writes them."""
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers + cfg.nextn):
        out.update(layer_shapes(cfg, spec, i))
    out.update({"output_norm.weight": (cfg.hidden,), "output.weight": (cfg.vocab, cfg.hidden)})
    return out


def write_preset(path: str | Path, p: Preset, quant: str = "q4_k_m", seed: int = 0) -> None:
    """Write preset `p` to `path` with random weights of types `quant` (type or mix)."""
    quant = check_quant(quant)
    p.cfg.check()
    spec, tensors = arch_spec(p.arch), plan(p, quant)
    gen = _Weights(p.cfg, tensors, np.random.Generator(np.random.Philox(seed)))  # fast raw bits
    w = GGUFWriter(str(path), spec.name)
    try:
        add_metadata(
            w,
            p.cfg,
            spec,
            f"kvq-{p.name}-random-s{seed}",
            quant=quant,
            context=p.context,
            rope_base=p.rope_base,
            rms_eps=p.rms_eps,
        )
        if p.yarn is not None:
            factor, original, log_mul = p.yarn
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(original)
            if log_mul:
                w.add_rope_scaling_yarn_log_mul(log_mul)
        bpe.add_vocab(w, bpe.tiny_vocab(p.cfg.vocab))
        for t in tensors:
            block, size = GGML_QUANT_SIZES[t.qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(1) as pool:  # one worker: the rng is used in tensor order
            pending = pool.submit(gen.tensor_bytes, tensors[0])
            for nxt in [*tensors[1:], None]:
                data = pending.result()
                if nxt is not None:
                    pending = pool.submit(gen.tensor_bytes, nxt)
                w.write_tensor_data(data)
    finally:
        w.close()


class _Weights:
    """The bytes of each planned tensor, in plan order (see the module docstring)."""

    def __init__(
        self, cfg: TinyConfig, plan: list[PlannedTensor], rng: np.random.Generator
    ) -> None:
        self.cfg, self.rng = cfg, rng
        self.embd_type = next(t.qtype for t in plan if t.name == "token_embd.weight")

    def tensor_bytes(self, t: PlannedTensor) -> U8:
        h, name = self.cfg.hidden, t.name
        if len(t.shape) == 1:  # norms near 1, biases and the shared-expert gate small
            base = 1.0 if name.endswith("norm.weight") else 0.0
            vec = base + self.rng.standard_normal(t.shape[0]) * (0.05 if base else h**-0.5)
            return encode(vec, Q.F32)
        if name.endswith("ffn_gate_inp.weight"):
            return encode(self._router(int(name.split(".")[1]), t.shape), Q.F32)
        scale = _OUT if ("attn_output" in name or "ffn_down" in name) else 1.0
        if name == "output.weight":
            scale = _LOGITS
        if name == "token_embd.weight":
            return self._embedding(t)
        return random_blocks(t.qtype, t.shape, scale / np.sqrt(t.shape[-1]), self.rng)

    def _embedding(self, t: PlannedTensor) -> U8:
        """Unit-rms random rows whose first `_shared_width` columns are one constant block."""
        raw = random_blocks(t.qtype, t.shape, 1.0, self.rng)  # [V, row bytes]
        width = _shared_width(t.shape[1], t.qtype)
        if width:
            shared = encode(np.ones((1, width), np.float32), t.qtype)  # [1, bytes]
            raw[:, : shared.shape[1]] = shared
        return raw

    def _router(self, layer: int, shape: tuple[int, ...]) -> npt.NDArray[np.float64]:
        e, h = shape
        width = _shared_width(h, self.embd_type)
        u = np.zeros(h)
        u[:width] = width**-0.5 if width else 0.0
        # u . x at layer i: sqrt(width) for the embedding, shrinking as the residual grows
        growth = np.sqrt(1.0 + 2.0 * layer * _OUT**2) / np.sqrt(max(width, 1))
        zipf = (_SKEW / np.arange(1, e + 1))[self.rng.permutation(e)]  # [E]
        noise = self.rng.standard_normal(shape) / np.sqrt(h)  # [E, H]
        return np.asarray(noise + np.outer(zipf * growth, u), dtype=np.float64)


def _shared_width(hidden: int, qtype: GGMLQuantizationType) -> int:
    """Columns shared by every embedding row: an eighth of the row in whole blocks, at least
    one block, and none if the row is a single block (every token would look alike)."""
    block = int(GGML_QUANT_SIZES[qtype][0])
    if hidden // block < 2:
        return 0
    return max(block, hidden // 8 // block * block)
