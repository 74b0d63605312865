"""kvq's Gated DeltaNet layer against a slow float64 numpy reference written from the published
recurrence (token by token, scalar loops), for prefill, token-by-token decode, a prefill split
in parts, and several sequences whose states must stay apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.model.deltanet import DeltaDims, DeltaState, DeltaWeights, _chunk, deltanet

EPS = 1e-6
H = 24
DIMS = DeltaDims(k_heads=2, v_heads=4, head_dim=8, conv=4)


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    c, vd = DIMS.channels, DIMS.value_dim
    return {
        "wqkv": rng.normal(0, 0.3, (c, H)),
        "wgate": rng.normal(0, 0.3, (vd, H)),
        "conv": rng.normal(0, 0.5, (c, DIMS.conv)),
        "dt_bias": rng.normal(0, 0.5, DIMS.v_heads),
        "a": -np.exp(rng.normal(0, 0.5, DIMS.v_heads)),  # -exp(A_log)
        "wbeta": rng.normal(0, 0.3, (DIMS.v_heads, H)),
        "walpha": rng.normal(0, 0.3, (DIMS.v_heads, H)),
        "norm": rng.normal(1, 0.1, DIMS.head_dim),
        "wout": rng.normal(0, 0.3, (H, vd)),
    }


def _torch_weights(w: dict[str, np.ndarray]) -> DeltaWeights:
    return DeltaWeights(**{k: torch.tensor(v, dtype=torch.float32) for k, v in w.items()})


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x: float) -> float:
    return x * _sigmoid(x)


def reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """float64, one token at a time with explicit loops: y [T, H] of a fresh sequence."""
    t_len = x.shape[0]
    kdim, d, hk, hv, kc = DIMS.key_dim, DIMS.head_dim, DIMS.k_heads, DIMS.v_heads, DIMS.conv
    c = DIMS.channels
    mixed = x @ w["wqkv"].T  # [T, C]
    s = np.zeros((hv, d, d))  # S[h][v][k]
    ys = np.zeros((t_len, H))
    for t in range(t_len):
        conv = np.zeros(c)
        for ch in range(c):
            acc = 0.0
            for j in range(kc):  # tap j reads input t - (K-1) + j (zero before the start)
                src = t - (kc - 1) + j
                if src >= 0:
                    acc += mixed[src, ch] * w["conv"][ch, j]
            conv[ch] = _silu(acc)
        o = np.zeros((hv, d))
        for h in range(hv):
            kh = h % hk
            q = conv[kh * d : (kh + 1) * d]
            k = conv[kdim + kh * d : kdim + (kh + 1) * d]
            v = conv[2 * kdim + h * d : 2 * kdim + (h + 1) * d]
            q = q / np.sqrt(np.sum(q * q) + EPS) / np.sqrt(d)
            k = k / np.sqrt(np.sum(k * k) + EPS)
            beta = _sigmoid(float(x[t] @ w["wbeta"][h]))
            a_in = float(x[t] @ w["walpha"][h]) + w["dt_bias"][h]
            g = w["a"][h] * np.log1p(np.exp(a_in))
            s[h] *= np.exp(g)
            for i in range(d):  # S <- S + beta (v - S k) k^T
                err = v[i] - sum(s[h, i, j] * k[j] for j in range(d))
                for j in range(d):
                    s[h, i, j] += beta * err * k[j]
            o[h] = [sum(s[h, i, j] * q[j] for j in range(d)) for i in range(d)]
        z = x[t] @ w["wgate"].T
        y = np.zeros(hv * d)
        for h in range(hv):
            oh = o[h] / np.sqrt(np.mean(o[h] ** 2) + EPS) * w["norm"]
            for i in range(d):
                y[h * d + i] = oh[i] * _silu(z[h * d + i])
        ys[t] = w["wout"] @ y
    return ys


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(3)
    w = _weights(rng)
    x = rng.normal(0, 1, (9, H))
    return x, w, reference(x, w)


def _run(state: DeltaState, x: np.ndarray, tw: DeltaWeights) -> torch.Tensor:
    conv, ssm = state.get(0)
    y, conv2, ssm2 = deltanet(torch.tensor(x, dtype=torch.float32), tw, DIMS, conv, ssm, EPS)
    state.stage(0, conv2, ssm2)
    state.commit()
    return y


def test_prefill_matches_reference(case: tuple[np.ndarray, dict, np.ndarray]) -> None:
    x, w, ref = case
    y = _run(DeltaState([0], DIMS), x, _torch_weights(w))
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parts", [[1] * 9, [3, 1, 1, 4], [5, 4]])
def test_decode_and_split_prefill_match(
    case: tuple[np.ndarray, dict, np.ndarray], parts: list[int]
) -> None:
    x, w, ref = case
    tw, state, ys, start = _torch_weights(w), DeltaState([0], DIMS), [], 0
    for n in parts:
        ys.append(_run(state, x[start : start + n], tw))
        start += n
    np.testing.assert_allclose(torch.cat(ys).numpy(), ref, rtol=1e-4, atol=1e-5)


def test_sequences_keep_their_own_state(case: tuple[np.ndarray, dict, np.ndarray]) -> None:
    x, w, ref = case
    rng = np.random.default_rng(9)
    x2 = rng.normal(0, 1, (6, H))
    ref2 = reference(x2, w)
    tw = _torch_weights(w)
    a, b = DeltaState([0], DIMS), DeltaState([0], DIMS)
    ya = [_run(a, x[:4], tw)]
    yb = [_run(b, x2[:2], tw)]
    for i in range(4, 9):  # interleaved decode steps
        ya.append(_run(a, x[i : i + 1], tw))
        if i - 2 < 6:
            yb.append(_run(b, x2[i - 2 : i - 1], tw))
    np.testing.assert_allclose(torch.cat(ya).numpy(), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(torch.cat(yb).numpy(), ref2[:6], rtol=1e-4, atol=1e-5)


def test_discarded_pass_leaves_state(case: tuple[np.ndarray, dict, np.ndarray]) -> None:
    x, w, ref = case
    tw, state = _torch_weights(w), DeltaState([0], DIMS)
    first = _run(state, x[:5], tw)
    conv, ssm = state.get(0)
    _, c2, s2 = deltanet(torch.tensor(x[5:], dtype=torch.float32), tw, DIMS, conv, ssm, EPS)
    state.stage(0, c2, s2)
    state.discard()  # the pass failed elsewhere: the retry starts from the same state
    rest = _run(state, x[5:], tw)
    np.testing.assert_allclose(torch.cat((first, rest)).numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("chunk", "decay"), [(4, 0.5), (7, 0.5), (64, 0.5), (4, 30.0)])
def test_chunked_rule_equals_the_recurrence(chunk: int, decay: float) -> None:
    """The chunked delta rule (`_chunk`: a triangular solve per block of tokens) against the
    recurrence written out token by token, float64, 50 tokens from a nonzero state; blocks that
    divide the tokens and blocks that do not, and decays strong enough (g down to -30 per
    token) that e^G underflows within a block."""
    gen = torch.Generator().manual_seed(4)
    t, hv, d, f64 = 50, 4, 8, torch.float64
    q = torch.randn(t, hv, d, generator=gen, dtype=f64) / d**0.5
    k = torch.nn.functional.normalize(torch.randn(t, hv, d, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(t, hv, d, generator=gen, dtype=f64)
    beta = torch.rand(t, hv, generator=gen, dtype=f64)
    g = -torch.rand(t, hv, generator=gen, dtype=f64) * decay
    s0 = torch.randn(hv, d, d, generator=gen, dtype=f64)
    s, want = s0.clone(), []
    for i in range(t):
        s = s * torch.exp(g[i])[:, None, None]
        err = v[i] - torch.einsum("hvk,hk->hv", s, k[i])  # [Hv, Dv]
        s = s + (beta[i, :, None] * err)[..., None] * k[i][:, None, :]
        want.append(torch.einsum("hvk,hk->hv", s, q[i]))
    outs, st = [], s0
    for i in range(0, t, chunk):
        o, st = _chunk(
            q[i : i + chunk],
            k[i : i + chunk],
            v[i : i + chunk],
            beta[i : i + chunk],
            g[i : i + chunk],
            st,
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), torch.stack(want), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st, s, rtol=1e-10, atol=1e-10)
