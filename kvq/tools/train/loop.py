"""The training loop: batches from a token stream, AdamW with warmup and cosine decay,
checkpoints that a rerun resumes from, and the held-out loss.

Every batch is drawn from `numpy.random.default_rng((seed, step))`, so a run resumed from a
checkpoint draws the batches an uninterrupted run draws. A sample is `<|endoftext|>` (BOS)
followed by `seq` tokens of the stream from a random offset; the loss is over the `seq`
predictions after BOS, as a model is run (kvq and llama.cpp put BOS first).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from kvq.tools.train.net import MoeLM, NetConfig

Stream = npt.NDArray[np.uint16]
BOS = 0  # `<|endoftext|>`


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How one model is trained."""

    seed: int
    steps: int
    batch: int  # sequences a step
    seq: int  # tokens a sequence after BOS
    lr: float
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    aux_coef: float = 0.01  # the load-balancing loss's weight
    eval_every: int = 100
    eval_chunks: int = 16  # held-out chunks of `seq` scored at each eval
    ckpt_every: int = 50
    max_minutes: float = 0.0  # stop early (recorded) past this wall time; 0: no limit
    stop_at: int = 0  # stop after this step (0: at `steps`): a time-capped run's exact rerun


def batch_at(stream: Stream, cfg: TrainConfig, step: int) -> torch.Tensor:
    """Step `step`'s batch [batch, seq + 1] (BOS first)."""
    rng = np.random.default_rng((cfg.seed, step))
    starts = rng.integers(0, len(stream) - cfg.seq, size=cfg.batch)
    rows = np.stack([stream[s : s + cfg.seq] for s in starts]).astype(np.int64)
    bos = np.full((cfg.batch, 1), BOS, dtype=np.int64)
    return torch.from_numpy(np.concatenate([bos, rows], axis=1))


def held_out_chunks(stream: Stream, seq: int, n: int) -> torch.Tensor:
    """The first `n` (0: all) whole chunks of `seq` tokens, BOS first: [n, seq + 1]."""
    total = len(stream) // seq if n == 0 else min(n, len(stream) // seq)
    rows = stream[: total * seq].astype(np.int64).reshape(total, seq)
    return torch.from_numpy(np.concatenate([np.full((total, 1), BOS), rows], axis=1))


@torch.no_grad()
def mean_nll(model: MoeLM, chunks: torch.Tensor, batch: int = 8) -> float:
    """Mean negative log-likelihood (nats a token) of every prediction after BOS."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch):
        c = chunks[i : i + batch]
        logits, _ = model(c[:, :-1])
        nll = F.cross_entropy(logits.flatten(0, 1), c[:, 1:].flatten(), reduction="sum")
        total, count = total + float(nll), count + c[:, 1:].numel()
    model.train()
    return total / count


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def optimizer(model: MoeLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass(slots=True)
class RunState:
    """What a checkpoint holds besides the weights."""

    step: int = 0
    wall_s: float = 0.0  # training time over every resumed run
    curve: list[dict[str, float]] | None = None  # {step, loss, aux, lr, held_out_nll?}
    stopped_early: bool = False


def train(
    net: NetConfig,
    cfg: TrainConfig,
    stream: Stream,
    held: Stream,
    ckpt: Path,
    log: Callable[[str], None] = print,
) -> tuple[MoeLM, RunState]:
    """Train (resuming from `ckpt` if it exists) and return the model and its state."""
    torch.manual_seed(cfg.seed)
    model = MoeLM(net)
    model.init_weights(cfg.seed)
    opt = optimizer(model, cfg)
    state = RunState(curve=[])
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = RunState(**saved["state"])
        log(f"resumed {ckpt} at step {state.step}")
    eval_set = held_out_chunks(held, cfg.seq, cfg.eval_chunks)
    t0, base = time.monotonic(), state.wall_s
    while state.step < cfg.steps:
        rec = _one_step(model, opt, cfg, stream, state.step)
        state.step += 1
        state.wall_s = base + time.monotonic() - t0
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            rec["held_out_nll"] = mean_nll(model, eval_set)
        assert state.curve is not None
        state.curve.append(rec)
        log(json.dumps({"step": state.step, "wall_s": round(state.wall_s, 1), **rec}))
        late = (cfg.max_minutes and state.wall_s > cfg.max_minutes * 60) or (
            state.step == cfg.stop_at
        )
        if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps or late:
            save(ckpt, model, opt, state)
        if late:
            state.stopped_early = True
            save(ckpt, model, opt, state)
            log(
                f"stopped at step {state.step} (max_minutes {cfg.max_minutes}, stop_at {cfg.stop_at})"
            )
            break
    return model, state


def _one_step(
    model: MoeLM, opt: torch.optim.AdamW, cfg: TrainConfig, stream: Stream, step: int
) -> dict[str, float]:
    lr = lr_at(cfg, step)
    for g in opt.param_groups:
        g["lr"] = lr
    ids = batch_at(stream, cfg, step)
    logits, aux = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    (loss + cfg.aux_coef * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {"step": float(step + 1), "loss": loss.item(), "aux": aux.item(), "lr": lr}


def save(path: Path, model: MoeLM, opt: torch.optim.AdamW, state: RunState) -> None:
    """Write the checkpoint atomically (a crash mid-write keeps the previous one)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": asdict(state)}, tmp)
    tmp.replace(path)


def summary(state: RunState) -> dict[str, Any]:
    """The loss curve thinned for the record: every eval point and every 25th step."""
    curve = state.curve or []
    kept = [r for r in curve if "held_out_nll" in r or int(r["step"]) % 25 == 0]
    return {"steps_done": state.step, "train_wall_s": round(state.wall_s, 1), "curve": kept}
