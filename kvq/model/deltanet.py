"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next), as llama.cpp's `qwen35moe` runs it.

A linear-attention layer keeps no KV cache: each sequence carries a fixed-size recurrent state
instead, the last `conv - 1` inputs of its causal depthwise conv1d and one `[Dv, Dk]` matrix
per value head (`DeltaState`). Per token t (llama.cpp's `build_layer_attn_linear` and its
gated_delta_net op):

    c_t      = silu(conv1d([conv state ; x_t W_qkv]))     q, k, v = split(c_t)
    q, k     = l2norm(q), l2norm(k)   (x / sqrt(sum x^2 + eps)); k heads tiled: head h uses h % Hk
    g_t      = a * softplus(x_t W_alpha + dt_bias)          a = -exp(A_log), stored as ssm_a
    beta_t   = sigmoid(x_t W_beta)
    S        = S * exp(g_t);   S = S + beta_t (v_t - S k_t) k_t^T;   o_t = S q_t / sqrt(Dk)
    y_t      = W_out (rmsnorm(o_t) * ssm_norm * silu(x_t W_gate))   (per value head)

A prefill runs the rule in blocks of `CHUNK` tokens in its chunked form (`_chunk`), which
equals the token loop above up to rounding. A pass computes the new state without touching
the old (`deltanet` returns it); the caller commits it with the KV cache's positions
(`DeltaState.commit`), so a failed pass leaves the sequence as it was, as `KVCache` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvq.errors import ModelError
from kvq.model.layers import gated, linear, rms_norm
from kvq.model.qstack import Weight
from kvq.model.rowwise import pointwise


@dataclass(frozen=True, slots=True)
class DeltaDims:
    """The sizes of a Gated DeltaNet layer (GGUF `<arch>.ssm.*`)."""

    k_heads: int  # ssm.group_count
    v_heads: int  # ssm.time_step_rank
    head_dim: int  # ssm.state_size (keys and values alike)
    conv: int  # ssm.conv_kernel

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_dim

    @property
    def channels(self) -> int:
        """The conv's channels: q, k, then v."""
        return 2 * self.key_dim + self.value_dim


@dataclass
class DeltaWeights:
    """One linear-attention layer's weights, [out, in] order (GGUF names in comments)."""

    wqkv: Weight  # [C, H]   attn_qkv
    wgate: Weight  # [Hv*D, H] attn_gate (z)
    conv: torch.Tensor  # [C, K]   ssm_conv1d
    dt_bias: torch.Tensor  # [Hv]    ssm_dt.bias
    a: torch.Tensor  # [Hv]      ssm_a = -exp(A_log)
    wbeta: Weight  # [Hv, H]   ssm_beta
    walpha: Weight  # [Hv, H]  ssm_alpha
    norm: torch.Tensor  # [D]      ssm_norm
    wout: Weight  # [H, Hv*D]  ssm_out


class DeltaState:
    """One sequence's recurrent state for every linear-attention layer, beside its KV cache.

    `conv[r]`: [K-1, C], the last inputs of layer row r's conv; `ssm[r]`: [Hv, D, D] (value
    index first). Zero for a new sequence. A pass stages each layer's new state (`stage`);
    `commit` makes them current once the whole pass succeeded, `discard` drops them."""

    def __init__(
        self,
        layers: list[int],
        dims: DeltaDims,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layers = list(layers)
        self._row = {layer: r for r, layer in enumerate(layers)}
        n, d = len(layers), dims.head_dim
        self.conv = torch.zeros((n, dims.conv - 1, dims.channels), device=device, dtype=dtype)
        self.ssm = torch.zeros((n, dims.v_heads, d, d), device=device, dtype=dtype)
        self._staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (conv, ssm) state of `layer`."""
        r = self._row[layer]
        return self.conv[r], self.ssm[r]

    def stage(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Stage `layer`'s state after the whole pass."""
        self.stage_rows(layer, [(conv, ssm)])

    def stage_rows(self, layer: int, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Stage `layer`'s state after each row of the pass (`states[i]`: after i + 1 rows),
        so that a speculative pass can commit the state after its accepted rows only."""
        if layer not in self._row:
            raise ModelError(f"layer {layer} is not a linear-attention layer of this state")
        self._staged[layer] = states

    def commit(self, rows: int = 0) -> None:
        """Make the staged states current (after every layer of the pass ran): those after
        `rows` rows where the pass staged one per row, else the pass's last."""
        for layer, states in self._staged.items():
            conv, ssm = states[rows - 1] if 0 < rows <= len(states) else states[-1]
            r = self._row[layer]
            self.conv[r], self.ssm[r] = conv, ssm
        self._staged.clear()

    def discard(self) -> None:
        self._staged.clear()


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp's build_gdn_l2_norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def deltanet(
    x: torch.Tensor,
    w: DeltaWeights,
    dims: DeltaDims,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's T new rows x [T, H] through the layer, from its committed state
    (conv [K-1, C], ssm [Hv, D, D]). Returns (y [T, H], new conv, new ssm); the inputs are
    not modified. A batch of sequences runs `project` and `output` once over all its rows
    and `recur` per sequence (`Attention._delta`, `kvq.model.attention`)."""
    mixed, z, beta, g = project(x, w)
    o, conv, ssm = recur(mixed, beta, g, w, dims, conv_state, ssm_state, eps)
    return output(o, z, w, dims, eps), conv, ssm


def project(
    x: torch.Tensor, w: DeltaWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-wise projections of x [N, H] (any rows, of any sequences): the conv's input
    [N, C], the output gate z [N, Hv*D], beta and the log decay g [N, Hv]."""
    beta = pointwise(torch.sigmoid, linear(x, w.wbeta))  # [N, Hv]
    g = pointwise(F.softplus, linear(x, w.walpha) + w.dt_bias) * w.a  # [N, Hv], <= 0
    return linear(x, w.wqkv), linear(x, w.wgate), beta, g


# tokens per block of the chunked recurrence (a prefill's cost is T / CHUNK small solves)
CHUNK = 64


def recur(
    mixed: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    w: DeltaWeights,
    dims: DeltaDims,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    eps: float,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's T rows of `project` through the conv and the delta rule, from its
    committed state. Returns (o [T, Hv, D], new conv [K-1, C], new ssm [Hv, D, D]).

    The rule runs `chunk` tokens at a time in its chunked form (`_chunk`), which equals the
    token-by-token recurrence up to rounding; a single token (decode) takes one step."""
    t, d, hv = mixed.shape[0], dims.head_dim, dims.v_heads
    seq = torch.cat((conv_state, mixed))  # [K-1+T, C]
    win = seq.unfold(0, dims.conv, 1)  # [T, C, K]: each row's causal window
    pre = (win * w.conv).sum(-1)  # [T, C]
    c = gated(pre, pre.new_ones(()))  # silu, written once in kvq.model.layers
    kd = dims.key_dim
    q = l2_norm(c[:, :kd].reshape(t, dims.k_heads, d), eps)
    k = l2_norm(c[:, kd : 2 * kd].reshape(t, dims.k_heads, d), eps)
    v = c[:, 2 * kd :].reshape(t, hv, d)  # [T, Hv, D]
    tile = torch.arange(hv, device=mixed.device) % dims.k_heads  # value head h: key head h % Hk
    q, k = q[:, tile] / d**0.5, k[:, tile]  # [T, Hv, D]
    s = ssm_state  # [Hv, Dv, Dk]
    outs = []
    for i in range(0, t, chunk):
        part = slice(i, min(t, i + chunk))
        o, s = _chunk(q[part], k[part], v[part], beta[part], g[part], s)
        outs.append(o)
    return torch.cat(outs), seq[seq.shape[0] - (dims.conv - 1) :].clone(), s


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    s0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of the gated delta rule from state s0 [Hv, Dv, Dk]; q, k, v [L, Hv, D],
    beta, g [L, Hv]. Returns (o [L, Hv, Dv], the state after them).

    Token by token: S_t = e^{g_t} S_{t-1} + u_t k_t^T with u_t = beta_t (v_t - e^{g_t}
    S_{t-1} k_t), o_t = S_t q_t. With G_t = g_1 + ... + g_t, unrolling S_{t-1} from s0 gives
    u_t + beta_t sum_{j<t} e^{G_t - G_j} (k_t . k_j) u_j = beta_t (v_t - e^{G_t} s0 k_t), a
    unit lower-triangular system for all u at once, then o_t = e^{G_t} s0 q_t +
    sum_{j<=t} e^{G_t - G_j} (q_t . k_j) u_j and S_L = e^{G_L} s0 + sum_j e^{G_L - G_j} u_j k_j^T.
    Every exponent used is <= 0 (the decays only shrink), so nothing overflows."""
    if q.shape[0] == 1:  # one step: the recurrence as it reads
        s = s0 * torch.exp(g[0])[:, None, None]
        delta = beta[0, :, None] * (v[0] - torch.einsum("hvk,hk->hv", s, k[0]))
        s = s + delta[:, :, None] * k[0][:, None, :]
        return torch.einsum("hvk,hk->hv", s, q[0])[None], s
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, L, D]
    bh, gh = beta.T, g.T.cumsum(-1)  # [Hv, L]: beta, G
    n = qh.shape[1]
    diff = gh[:, :, None] - gh[:, None, :]  # [Hv, L, L]: G_t - G_j
    ones = torch.ones(n, n, dtype=torch.bool, device=q.device)
    upto = torch.exp(diff.masked_fill(~ones.tril(), float("-inf")))  # j <= t
    before = upto.masked_fill(~ones.tril(-1), 0.0)  # j < t
    a = bh[:, :, None] * (kh @ kh.transpose(1, 2)) * before  # [Hv, L, L]
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    eg = torch.exp(gh)[..., None]  # [Hv, L, 1]
    b = bh[..., None] * (vh - eg * (kh @ s0.transpose(1, 2)))  # [Hv, L, Dv]
    u = torch.linalg.solve_triangular(eye + a, b, upper=False, unitriangular=True)
    o = eg * (qh @ s0.transpose(1, 2)) + ((qh @ kh.transpose(1, 2)) * upto) @ u  # [Hv, L, Dv]
    tail = torch.exp(gh[:, -1:] - gh)[..., None]  # [Hv, L, 1]: e^{G_L - G_j}
    s = torch.exp(gh[:, -1])[:, None, None] * s0 + (u * tail).transpose(1, 2) @ kh
    return o.transpose(0, 1), s


def output(
    o: torch.Tensor, z: torch.Tensor, w: DeltaWeights, dims: DeltaDims, eps: float
) -> torch.Tensor:
    """y = W_out (rmsnorm(o) * ssm_norm * silu(z)) per value head. o [N, Hv, D], z [N, Hv*D].
    Returns [N, H]."""
    n, hv, d = o.shape[0], dims.v_heads, dims.head_dim
    y = gated(z.view(n, hv, d), rms_norm(o, w.norm, eps))  # silu(z) * the normed output
    return linear(y.reshape(n, hv * d), w.wout)
