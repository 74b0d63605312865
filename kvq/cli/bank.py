"""Hot/cold bank commands: `kvq balance collect|rerank|plan`, `kvq bench bank`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

Subparsers = Any


def _on_rq(settings: Settings, func: Any, *args: Any) -> Any:
    """Run a coarse job on RQ (a running `kvq monitor` executes it) and wait for its result."""
    import os

    from kvq.errors import ConfigError
    from kvq.monitor.coarse import JOB_TIMEOUT_S, CoarseJobs

    if not settings.coarse_url:
        raise ConfigError("--rq needs a standalone Redis for RQ: set KVQ_RQ_URL")
    jobs = CoarseJobs(settings.coarse_url, settings.prefix, f"cli-{os.getpid()}")
    try:
        job = jobs.enqueue(func, *args)
        print(f"RQ job {job.id} queued; waiting for a monitor to run it", file=sys.stderr)
        return jobs.wait(job, JOB_TIMEOUT_S)
    finally:
        jobs.close()


def cmd_collect(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bank.collect import read_prompts
    from kvq.device import pick_device
    from kvq.monitor import coarse

    prompts, device = read_prompts(args.prompts), str(pick_device(settings.device))
    if args.rq:
        out = _on_rq(
            settings,
            coarse.collect_histogram,
            str(Path(args.model).resolve()),
            prompts,
            args.tokens,
            str(Path(args.out).resolve()),
            device,
        )
    else:
        out = coarse.collect_histogram(args.model, prompts, args.tokens, args.out, device)
    print(f"wrote {out['out']}: {out['layers']} layers, {out['routed']} routed pairs")
    return EXIT_OK


def cmd_rerank(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bank.hist import load_hist, rerank, save_hist

    out = rerank(load_hist(args.ref), load_hist(args.traffic), args.prior_per_expert)
    save_hist(out, args.out)
    print(f"wrote {args.out}: {len(out.layers)} layers re-ranked for {args.traffic}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.bank.hist import load_hist
    from kvq.bank.hot_set import plan_hot_set
    from kvq.bank.options import GIB
    from kvq.errors import ConfigError

    if not args.budget_gib >= 0:
        raise ConfigError(f"--budget-gib {args.budget_gib} must be a number >= 0")
    if args.rq:
        from kvq.monitor import coarse

        doc = _on_rq(
            settings,
            coarse.plan_hot_set,
            str(Path(args.hist).resolve()),
            int(args.budget_gib * GIB),
        )
        print(json.dumps(doc))
        return EXIT_OK
    hist = load_hist(args.hist)
    plan = plan_hot_set(hist.layers, int(args.budget_gib * GIB))
    if args.json:
        print(json.dumps(plan.to_json()))
        return EXIT_OK
    for layer, ids in sorted(plan.hot.items()):
        print(f"layer {layer:>3}: {len(ids):>4} hot  {' '.join(map(str, ids))}")
    print(
        f"bytes used    {plan.bytes_used} of {plan.budget_bytes} ({plan.bytes_used / GIB:.3f} GiB)"
    )
    print(f"covered share {plan.covered_share:.4f} of routed pairs")
    print(f"method        {plan.method}; greedy gap {plan.greedy_gap:.4f}")
    for note in plan.notes:
        print(f"note          {note}")
    return EXIT_OK


def cmd_bench_bank(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.bank import TraceSpec, run_bank_bench

    result = run_bank_bench(TraceSpec(seed=args.seed))
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    for key in ("static_before", "dynamic_before", "static_after", "dynamic_after"):
        print(f"{key:<22} {result[key]:.3f}")
    for key in ("pingpong_swaps", "dynamic_swaps", "planner_ms_61x256", "greedy_gap_mixed"):
        print(f"{key:<22} {result[key]:.4g}")
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    """balance collect|rerank|plan, bench bank."""
    b = sub.add_parser("balance", help="routing histograms and hot-set plans (docs/bank.md)")
    bsub = b.add_subparsers(dest="balance_cmd", required=True)

    c = bsub.add_parser("collect", help="count routings of a prompt sample -> HIST.json")
    c.add_argument("--model", required=True, help="GGUF file")
    c.add_argument("--prompts", required=True, help="text file, one prompt per line")
    c.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    c.add_argument("-o", "--out", required=True, help="HIST.json to write")
    c.add_argument(
        "--rq", action="store_true", help="run it as an RQ coarse job (a monitor runs it)"
    )
    c.set_defaults(fn=cmd_collect)

    r = bsub.add_parser("rerank", help="re-rank a reference histogram for your own traffic")
    r.add_argument("ref", help="reference HIST.json")
    r.add_argument("--traffic", required=True, help="HIST.json of your traffic")
    r.add_argument(
        "--prior-per-expert",
        type=float,
        default=16.0,
        help="weight of the reference, in routings per expert (default 16)",
    )
    r.add_argument("-o", "--out", required=True, help="HIST.json to write")
    r.set_defaults(fn=cmd_rerank)

    p = bsub.add_parser("plan", help="print the hot set for a budget")
    p.add_argument("--hist", required=True, help="HIST.json")
    p.add_argument("--budget-gib", type=float, required=True, help="hot budget in GiB")
    p.add_argument("--json", action="store_true", help="print JSON (for machines)")
    p.add_argument(
        "--rq",
        action="store_true",
        help="run it as an RQ coarse job (a monitor runs it); prints JSON",
    )
    p.set_defaults(fn=cmd_plan)

    bb = bench.add_parser("bank", help="static vs dynamic hot sets on a drifting trace")
    bb.add_argument("--seed", type=int, default=0, help="the same seed, the same trace")
    bb.add_argument("--json", action="store_true", help="print JSON (for machines)")
    bb.set_defaults(fn=cmd_bench_bank)
