"""The figures of `kvq bench pool`: one measured window, and the whole report.

Per window (deltas of the coordinator's counters over it): `tok_s`; `remote_share` = remote
jobs / all expert jobs; `wait_ms_per_layer_token` = the coordinator's `remote_wait_s` / (tokens
x MoE layers), which at 1 sequence is the wait of each layer of each step; `job_rtt_mean_ms`
(sent -> result read); `coord_cpu_ms_per_token` and `workers_cpu_ms_per_token` (user + system
CPU of the processes, from /proc); `jobs_per_layer_token` = remote jobs sent / (tokens x
layers). The report's `shape` and these per-token costs are what `kvq swarm-sim --throughput`
is calibrated from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvq.bus.histogram import Histogram
from kvq.bus.records import CoordStats

REPORT_KEYS = (
    "preset",
    "model",
    "file_bytes",
    "backbone_bytes",
    "expert_bytes",
    "slices",
    "shape",
    "workers",
    "cap_fraction",
    "budget_bytes",
    "cgroup_cap_bytes",
    "overhead_mib",
    "no_worker_holds_model",
    "survivors_hold_model",
    "netns",
    "cpus",
    "omp_num_threads",
    "microbatches",
    "copies",
    "max_tokens",
    "warmup_s",
    "measure_s",
    "heartbeat_ttl_s",
    "runs",
    "kill",
    "grain",
    "stage_layers",
    "verify",
)


def window(
    st0: CoordStats | None,
    st1: CoordStats | None,
    seconds: float,
    tokens: int,
    cpu0: dict[str, float],
    cpu1: dict[str, float],
    layers: int,
) -> dict[str, Any]:
    """The figures of one measured window of `seconds` in which `tokens` were streamed."""

    def d(field: str) -> Any:
        return getattr(st1, field) - getattr(st0, field) if st0 and st1 else 0

    local, remote, fallback = d("local_jobs"), d("remote_jobs"), d("fallback_jobs")
    jobs = local + remote + fallback
    per = 1000 / (tokens * layers) if tokens else 0.0
    rtt = _hist_delta(st0.job_rtt_s if st0 else "", st1.job_rtt_s if st1 else "")
    coord_cpu = cpu1["coordinator"] - cpu0["coordinator"]
    workers_cpu = cpu1["workers"] - cpu0["workers"]
    return {
        "tok_s": round(tokens / seconds, 3),
        "tokens": tokens,
        "window_s": round(seconds, 2),
        "remote_jobs": remote,
        "local_jobs": local,
        "fallback_jobs": fallback,
        "remote_share": round(remote / jobs, 3) if jobs else 0.0,
        "witness_jobs": d("witness_jobs"),
        "verified": d("verified"),
        "remote_rows": d("remote_rows"),
        "jobs_per_layer_token": round(d("remote_sent") * per / 1000, 3),
        "wait_share": round(d("remote_wait_s") / seconds, 3),
        "wait_ms_per_layer_token": round(d("remote_wait_s") * per, 3),
        "send_ms_per_layer_token": round(d("remote_send_s") * per, 3),
        "job_rtt_mean_ms": rtt,
        "coord_cpu_s": round(coord_cpu, 2),
        "workers_cpu_s": round(workers_cpu, 2),
        "coord_cpu_ms_per_token": round(1000 * coord_cpu / tokens, 3) if tokens else None,
        "workers_cpu_ms_per_token": round(1000 * workers_cpu / tokens, 3) if tokens else None,
        "stage_wait_ms_per_token": _stage_waits(st0, st1, tokens),
        "stage_replays": d("stage_replays"),
    }


def _stage_waits(st0: CoordStats | None, st1: CoordStats | None, tokens: int) -> dict[str, float]:
    """Stage grain: per span, the ms the coordinator waited for its jobs per token streamed."""
    if not st1 or not tokens:
        return {}
    after = json.loads(st1.stage_wait_s or "{}")
    before = json.loads(st0.stage_wait_s or "{}") if st0 else {}
    return {sid: round(1000 * (s - before.get(sid, 0.0)) / tokens, 3) for sid, s in after.items()}


def _hist_delta(before: str, after: str) -> float | None:
    """Mean of the observations made between two texts of one histogram, in ms."""
    h1 = Histogram.from_text(after)
    if h1 is None:
        return None
    h0 = Histogram.from_text(before)
    n = h1.count - (h0.count if h0 else 0)
    total = h1.sum - (h0.sum if h0 else 0.0)
    return round(1000 * total / n, 2) if n > 0 else None


def shape_of(meta: Any, slices: int) -> dict[str, int]:
    """The model figures the throughput model needs."""
    moe = meta.block_count - meta.leading_dense_block_count
    return {
        "layers": moe,
        "experts": meta.expert_count,
        "experts_used": meta.expert_used_count,
        "hidden": meta.embedding_length,
        "expert_ffn": meta.expert_feed_forward_length,
        "heads": meta.head_count,
        "kv_heads": meta.head_count_kv,
        "head_dim": meta.head_dim,
        "slices_per_layer": max(1, slices // max(1, moe)),
        "vocab": meta.vocab_size,
        "blocks": meta.block_count,
    }


def build(  # cfg: a kvq.tools.bench.pool.PoolBench (not imported: pool imports this module)
    cfg: Any,
    full: Path,
    backbone: Path,
    expert_bytes: int,
    slices: int,
    shape: dict[str, int],
    netns: bool,
    runs: list[dict[str, Any]],
    kill: dict[str, Any] | None,
    cpus: tuple[int, int],
) -> dict[str, Any]:
    budget = cfg.cap_fraction * expert_bytes
    out = {
        "preset": None if cfg.model else cfg.preset,
        "model": str(full),
        "file_bytes": full.stat().st_size,
        "backbone_bytes": backbone.stat().st_size,
        "expert_bytes": expert_bytes,
        "slices": slices,
        "shape": shape,
        "workers": cfg.workers,
        "cap_fraction": cfg.cap_fraction,
        "budget_bytes": int(budget),
        "cgroup_cap_bytes": int(budget) + cfg.overhead_mib * 2**20,
        "overhead_mib": cfg.overhead_mib,
        "no_worker_holds_model": cfg.cap_fraction < 1,
        "survivors_hold_model": (cfg.workers - 1) * cfg.cap_fraction >= 1,
        "netns": netns,
        "cpus": {"coordinator": cpus[0], "workers_redis_monitor_clients": cpus[1]},
        "omp_num_threads": 1,
        "microbatches": cfg.microbatches,
        "copies": cfg.copies,
        "max_tokens": cfg.max_tokens,
        "warmup_s": cfg.warmup_s,
        "measure_s": cfg.measure_s,
        "heartbeat_ttl_s": cfg.hb_ttl_s,
        "runs": runs,
        "kill": kill,
        "grain": cfg.grain,
        "stage_layers": cfg.stage_layers if cfg.grain == "stage" else None,
        "verify": cfg.verify,
    }
    assert tuple(out) == REPORT_KEYS
    return out


def lines(r: dict[str, Any]) -> list[str]:
    """The human report."""
    if "skipped" in r:
        return [r["skipped"]]
    gib = 2**30
    out = [
        f"{r['preset'] or r['model']}: {r['expert_bytes'] / gib:.2f} GiB of routed experts in "
        f"{r['slices']} slices; {r['workers']} workers, each capped at "
        f"{r['cgroup_cap_bytes'] / gib:.2f} GiB ({r['cap_fraction']}x the experts + "
        f"{r['overhead_mib']} MiB for the process); "
        f"{'own network namespaces' if r['netns'] else 'loopback'}; OMP_NUM_THREADS=1 each, "
        f"coordinator on CPU {r['cpus']['coordinator']}, the rest on CPU "
        f"{r['cpus']['workers_redis_monitor_clients']}",
        "  rtt_ms  seqs   tok/s  remote  wait ms/layer/tok  job rtt ms  failed  held MiB per worker",
    ]
    for run in r["runs"]:
        held = " ".join(f"{w['held_bytes'] / 2**20:.0f}" for w in run["workers"].values())
        out.append(
            f"  {run['rtt_ms']:>6} {run['sequences']:>5} {run['tok_s']:>7} "
            f"{run['remote_share']:>7} {run['wait_ms_per_layer_token']:>18} "
            f"{run['job_rtt_mean_ms']!s:>11} {run['failed_requests']:>7}  {held}"
        )
    k = r["kill"]
    if k and "skipped" in k:
        out.append(f"  SIGKILL phase skipped: {k['skipped']}")
    elif k:
        out.append(
            f"  SIGKILL of {k['victim']} ({k['victim_slices']} slices) at {k['rtt_ms']} ms, "
            f"{k['sequences']} sequences, {k['victim_only_copies']} of them its alone: every "
            f"slice held again after {k['recover_s']} s (None: not in {k['recover_timeout_s']} "
            f"s, {k['uncovered_after']} uncovered; heartbeat TTL {k['heartbeat_ttl_s']} s); "
            f"failed requests {k['failed_requests']} "
            f"of {k['failed_requests'] + k['completed_requests']}; longest token gap "
            f"{k['longest_token_gap_s']} s"
        )
    return out
