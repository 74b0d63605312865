"""`kvq bench elastic`: recruitment, boost stability and wind-down timed through real
processes (`kvq.tools.bench.elastic`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvq.cli.common import EXIT_OK
from kvq.config import Settings

Subparsers = Any  # argparse._SubParsersAction (private)


def cmd_bench_elastic(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.elastic import ElasticBench, run_elastic_bench

    cfg = ElasticBench(
        model=args.model,
        sequences=args.sequences,
        max_tokens=args.max_tokens,
        saturated_s=args.saturated_s,
        noisy_s=args.noisy_s,
        idle_release_s=args.idle_release_s,
        saturation_enter_s=args.saturation_enter_s,
        saturation_leave_s=args.saturation_leave_s,
        monitor_poll_s=args.monitor_poll_s,
        dispatch_policy=args.policy,
        seed=args.seed,
        log_dir=args.log_dir,
        cluster=args.cluster,
    )
    r = run_elastic_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    t = r["targets"]
    print(f"{r['model']} ({r['policy']} policy, {r['sequences']} clients)")
    print(
        f"  saturation -> first remote result: {r['saturation_to_first_remote_s']} s "
        f"(target <= {t['saturation_to_first_remote_s']})"
    )
    print(f"  remote share of expert jobs while saturated: {r['remote_share_saturated']}")
    print(
        f"  boost flips under a noisy load: {r['boost_flips']} in {r['noisy_window_s']} s = "
        f"{r['boost_flips_per_10min']} per 10 min (target <= {t['boost_flips_per_10min']})"
    )
    print(
        f"  drain -> slice released: {r['drain_to_release_s']} s (idle release "
        f"{r['idle_release_s']} s, saturation leave {r['saturation_leave_s']} s)"
    )
    return EXIT_OK


def register(sub: Subparsers, bench: Subparsers) -> None:
    """bench elastic."""
    e = bench.add_parser("elastic", help="saturation -> recruitment -> wind-down, timed")
    e.add_argument("--model", help="GGUF file (default: a generated 40 MB Q4_K model)")
    e.add_argument("--sequences", type=int, default=4, help="clients while saturated (>= 3)")
    e.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    e.add_argument("--saturated-s", type=float, default=30.0, help="saturated phase")
    e.add_argument("--noisy-s", type=float, default=45.0, help="load hovering at the threshold")
    e.add_argument(
        "--idle-release-s",
        type=float,
        default=10.0,
        help="KVQ_IDLE_RELEASE_S given to the worker (the setting's default is 90)",
    )
    e.add_argument("--saturation-enter-s", type=float, help="default: KVQ_SATURATION_ENTER_S's")
    e.add_argument("--saturation-leave-s", type=float, help="default: KVQ_SATURATION_LEAVE_S's")
    e.add_argument("--monitor-poll-s", type=float, help="default: KVQ_MONITOR_POLL_S's")
    e.add_argument(
        "--policy",
        choices=("capacity", "copies"),
        default="capacity",
        help="KVQ_DISPATCH_POLICY of the coordinator",
    )
    e.add_argument("--seed", type=int, default=0, help="seed of the noisy load")
    e.add_argument(
        "--cluster", type=int, default=0, metavar="N", help="on a local N-master Redis Cluster"
    )
    e.add_argument("--log-dir", help="keep the processes' logs here")
    e.add_argument("--json", action="store_true", help="print JSON (for machines)")
    e.set_defaults(fn=cmd_bench_elastic)
