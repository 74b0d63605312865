"""Swarm routing commands: `kvq swarm-sim`, `kvq bench swarm`, `kvq bench offload`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvq.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from kvq.config import Settings
from kvq.errors import RoutingError

Subparsers = Any


def _load_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise RoutingError(f"cannot read the {what} file {path!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise RoutingError(f"{what} file {path!r} is not JSON: {exc}") from exc


def cmd_swarm_sim(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.swarm import SimOptions, parse_nodes, parse_topology, simulate

    if args.throughput:
        return _throughput(args)
    if not args.topology:
        print(
            "kvq swarm-sim: error: --topology is required (or --throughput; see kvq "
            "swarm-sim --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        topo = parse_topology(_load_json(args.topology, "topology"))
        grow = parse_nodes(_load_json(args.grow, "growth")) if args.grow else ()
        opts = SimOptions(
            kills=tuple(args.kill or ()),
            grow=grow,
            removes=tuple(args.remove or ()),
            pipelines=args.pipelines,
            seed=args.seed,
            requests=args.requests,
            model=args.model,
            allow_degraded=not args.no_degrade,
        )
        report = simulate(topo, opts)
    except RoutingError as exc:  # bad input: unknown node or model, malformed or too small
        print(f"kvq swarm-sim: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report, indent=2))
    return EXIT_OK if report["final_plan_valid"] else EXIT_FAIL


def _throughput(args: argparse.Namespace) -> int:
    from kvq.swarm.calibrate import throughput_report

    try:
        reports = [_load_json(path, "bench report") for path in args.measured or ()]
        report = throughput_report(
            reports,
            args.shapes.split(","),
            args.workers,
            args.rtt_ms,
            args.batch,
            (args.coord_speedup, args.worker_speedup),
            args.calibrate,
        )
    except RoutingError as exc:  # a bad flag, an unreadable file, reports with no window
        print(f"kvq swarm-sim: RoutingError: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyError, TypeError) as exc:  # a JSON file that is no bench report
        print(
            f"kvq swarm-sim: RoutingError: not a usable kvq bench pool report: {exc!r}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(json.dumps(report, indent=2))
    return EXIT_OK


def cmd_bench_swarm(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.swarm import run_swarm_bench

    r = run_swarm_bench(args.nodes, args.models, args.routes, args.steps, args.seed)
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"routes_per_s  {r['routes_per_s']:>10}  ({r['nodes']} nodes, {r['models']} models, "
            f"{r['copies']} copies; steady {r['routes_per_s_steady']})"
        )
        print(
            f"sim_seconds   {r['sim_seconds']:>10}  ({r['sim_workers']} workers x "
            f"{r['sim_steps']} steps, digest {r['sim_digest']})"
        )
    return EXIT_OK


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return n


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of numbers, got {text!r}"
        ) from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}"
        ) from None


def cmd_bench_offload(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.offload import OffloadBench, run_offload_bench

    cfg = OffloadBench(
        model=args.model,
        rtts_ms=args.rtt_ms,
        microbatches=args.microbatches,
        sequences=args.sequences,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        log_dir=args.log_dir,
        cluster=args.cluster,
        repeat=args.repeat,
    )
    r = run_offload_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    print(
        f"{r['model']}: baseline (no worker) {r['baseline']['tok_s']} tok/s, experts "
        f"{r['baseline']['expert_share']:.0%} of the coordinator's time (a worker taking one "
        f"of two slices can give at most {r['split_bound']}x)"
    )
    for run in r["runs"]:
        print(
            f"  rtt {run['rtt_ms']:>5} ms, {run['microbatches']} micro-batch(es): "
            f"{run['tok_s']} tok/s against {run['baseline_tok_s']} all-local beside it, "
            f"speedup {run['speedup']}, remote share {run['remote_share']}, experts "
            f"{run['expert_share']:.0%} and waiting {run['wait_share']:.0%} of the "
            f"coordinator's time"
        )
    if r["repeat"] > 1:
        for row in r["summary"]:
            print(
                f"  rtt {row['rtt_ms']:>5} ms, {row['microbatches']} micro-batch(es): median "
                f"speedup {row['speedup_median']} of {row['speedups']}"
            )
    return EXIT_OK


def cmd_bench_microbatch(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.microbatch import MicrobatchBench, run_microbatch_bench

    cfg = MicrobatchBench(
        model=args.model,
        rtt_ms=args.rtt_ms,
        microbatches=args.microbatches,
        sequences=args.sequences,
        max_tokens=args.max_tokens,
        warmup_steps=args.warmup_steps,
        pairs=args.pairs,
        dispatch_policy=args.policy,
        log_dir=args.log_dir,
    )
    r = run_microbatch_bench(cfg)
    if args.json:
        print(json.dumps(r))
        return EXIT_OK
    for arm, a in r["arms"].items():
        print(
            f"{arm} micro-batch(es): {a['mean_ms']} ms per step (decode median "
            f"{a['decode_median_ms']} ms), {a['remote_jobs_per_step']} remote jobs per step"
        )
    print(
        f"ratio {r['microbatches']}/1: mean {r['mean_ratio']}, decode median "
        f"{r['decode_median_ratio']} (< 1: micro-batches win)"
    )
    return EXIT_OK


def cmd_bench_pool(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.pool import PoolBench, run_pool_bench
    from kvq.tools.bench.pool_report import lines

    cfg = PoolBench(
        preset=args.preset,
        model=args.model,
        cache_dir=args.cache_dir,
        workers=args.workers,
        cap_fraction=args.cap_fraction,
        overhead_mib=args.overhead_mib,
        rtts_ms=args.rtt_ms,
        sequences=args.sequences,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        kill=not args.no_kill,
        netns=not args.no_netns,
        hb_ttl_s=args.hb_ttl_s,
        microbatches=args.microbatches,
        copies=args.copies,
        log_dir=args.log_dir,
        grain=args.grain,
        stage_layers=args.stage_layers,
        verify=args.verify,
    )
    r = run_pool_bench(cfg)
    print(json.dumps(r) if args.json else "\n".join(lines(r)))
    return EXIT_OK


def _add_pool(bench: Subparsers) -> None:
    p = bench.add_parser("pool", help="a model no worker can hold, served by capped workers")
    p.add_argument("--preset", default="small", help="model shape written to --cache-dir")
    p.add_argument("--model", help="a GGUF file instead of the preset")
    p.add_argument("--cache-dir", default="~/.cache/kvq/pool", help="preset and backbone files")
    p.add_argument("--workers", type=_positive, default=3, help="worker processes")
    p.add_argument(
        "--cap-fraction",
        type=float,
        default=0.7,
        help="each worker's budget and cgroup cap, x the routed-expert bytes",
    )
    p.add_argument(
        "--overhead-mib",
        type=int,
        default=1024,
        help="added to the cgroup cap for the worker process itself",
    )
    p.add_argument("--rtt-ms", type=_floats, default=(0.0, 5.0, 20.0), help="comma list")
    p.add_argument("--sequences", type=_ints, default=(1, 8), help="comma list of loads")
    p.add_argument("--max-tokens", type=_positive, default=16, help="tokens per request")
    p.add_argument("--warmup-s", type=float, default=5.0, help="load before each window")
    p.add_argument("--measure-s", type=float, default=20.0, help="measured window")
    p.add_argument(
        "--heartbeat-ttl-s", dest="hb_ttl_s", type=float, default=3.0, help="KVQ_HEARTBEAT_TTL_S"
    )
    p.add_argument("--microbatches", type=_positive, default=1, help="KVQ_MICROBATCHES")
    p.add_argument(
        "--copies",
        type=_positive,
        default=2,
        help="KVQ_BACKBONE_REPLICAS: copies per slice wanted (no boost)",
    )
    p.add_argument(
        "--grain",
        choices=("expert", "stage"),
        default="expert",
        help="KVQ_GRAIN: expert slices, or layer spans served whole (X12)",
    )
    p.add_argument(
        "--stage-layers",
        type=_positive,
        default=4,
        help="KVQ_STAGE_LAYERS: blocks per stage slice (--grain stage)",
    )
    p.add_argument(
        "--verify",
        choices=("sampled", "all", "off"),
        default="sampled",
        help="KVQ_VERIFY_REMOTE (off: like for like with llama.cpp, which checks nothing)",
    )
    p.add_argument("--no-kill", action="store_true", help="skip the SIGKILL phase")
    p.add_argument("--no-netns", action="store_true", help="workers on loopback, no namespace")
    p.add_argument("--log-dir", help="the processes' logs (default: --cache-dir/logs)")
    p.add_argument("--json", action="store_true", help="print JSON (for machines)")
    p.set_defaults(fn=cmd_bench_pool)


def cmd_bench_llama_rpc(args: argparse.Namespace, settings: Settings) -> int:
    from kvq.tools.bench.llama_rpc import RpcBench, run_rpc_bench

    cfg = RpcBench(
        model=args.model,
        bin_dir=args.bin_dir,
        servers=args.servers,
        rtts_ms=args.rtt_ms,
        sequences=args.sequences,
        prompt_tokens=args.npp,
        gen_tokens=args.ntg,
    )
    r = run_rpc_bench(cfg)
    if args.json or "skipped" in r:
        print(json.dumps(r))
        return EXIT_OK
    for run in r["runs"]:
        print(
            f"rtt {run['rtt_ms']:g} ms, {run.get('sequences', '?')} sequences: "
            f"{run.get('tok_s', run.get('error'))} tok/s"
        )
    return EXIT_OK


def _add_llama_rpc(bench: Subparsers) -> None:
    p = bench.add_parser("llama-rpc", help="llama.cpp RPC over the same delayed links (peer)")
    p.add_argument("--model", required=True, help="the GGUF file kvq bench pool served")
    p.add_argument(
        "--bin-dir", default="", help="where ggml-rpc-server and llama-batched-bench are"
    )
    p.add_argument("--servers", type=_positive, default=3, help="ggml-rpc-server processes")
    p.add_argument("--rtt-ms", type=_floats, default=(0.0, 5.0, 20.0), help="comma list")
    p.add_argument("--sequences", type=_ints, default=(1, 8), help="comma list (-npl)")
    p.add_argument("--npp", type=_positive, default=16, help="prompt tokens per sequence")
    p.add_argument("--ntg", type=_positive, default=16, help="generated tokens per sequence")
    p.add_argument("--json", action="store_true", help="print JSON (for machines)")
    p.set_defaults(fn=cmd_bench_llama_rpc)


def register(sub: Subparsers, bench: Subparsers) -> None:
    """swarm-sim, bench swarm, bench offload, bench pool, bench llama-rpc."""
    _add_swarm_sim(sub)
    _add_bench_swarm(bench)
    _add_bench_offload(bench)
    _add_bench_microbatch(bench)
    _add_pool(bench)
    _add_llama_rpc(bench)


def _add_swarm_sim(sub: Subparsers) -> None:
    s = sub.add_parser("swarm-sim", help="run the swarm lifecycle in memory and print JSON")
    s.add_argument("--topology", metavar="FILE.json", help="nodes and models")
    s.add_argument("--kill", action="append", metavar="NODE", help="node that dies (repeatable)")
    s.add_argument("--pipelines", type=_positive, help="copies per model (default: topology's)")
    s.add_argument("--grow", metavar="NODES.json", help="nodes that join after the kills")
    s.add_argument("--remove", action="append", metavar="NODE", help="node retired (repeatable)")
    s.add_argument("--seed", type=int, default=0, help="seed of the simulated traffic")
    s.add_argument("--requests", type=int, default=64, help="simulated requests between steps")
    s.add_argument("--model", help="model whose route each step shows (default: the first)")
    s.add_argument("--no-degrade", action="store_true", help="forbid fallback models")
    t = s.add_argument_group("throughput model")
    t.add_argument(
        "--throughput",
        action="store_true",
        help="calibrate tok/s from bench reports and project (no --topology)",
    )
    t.add_argument(
        "--measured",
        action="append",
        metavar="BENCH.json",
        help="a kvq bench pool --json report (repeatable)",
    )
    t.add_argument(
        "--calibrate",
        type=int,
        default=0,
        metavar="N",
        help="calibrate from the first N reports (default 0: all); the others' "
        "windows are predicted",
    )
    t.add_argument("--shapes", default="qwen3-235b-a22b,deepseek-v3", help="comma list")
    t.add_argument("--workers", type=_ints, default=(8, 32, 128), help="comma list")
    t.add_argument("--rtt-ms", type=_floats, default=(20.0, 40.0, 80.0), help="comma list")
    t.add_argument("--batch", type=_positive, default=32, help="sequences of the batched column")
    t.add_argument(
        "--coord-speedup",
        type=float,
        default=1.0,
        help="the projected coordinator's speed over the bench's CPU",
    )
    t.add_argument(
        "--worker-speedup",
        type=float,
        default=1.0,
        help="each projected worker's speed over the bench's CPU",
    )
    s.set_defaults(fn=cmd_swarm_sim)


def _add_bench_swarm(bench: Subparsers) -> None:
    b = bench.add_parser("swarm", help="route decisions per second; a large seeded simulation")
    b.add_argument("--nodes", type=_positive, default=1000, help="simulated machines")
    b.add_argument("--models", type=_positive, default=4, help="simulated models")
    b.add_argument("--routes", type=_positive, default=200_000, help="route decisions timed")
    b.add_argument("--steps", type=_positive, default=10_000, help="simulation steps")
    b.add_argument("--seed", type=int, default=0, help="the same seed, the same run")
    b.add_argument("--json", action="store_true", help="print JSON (for machines)")
    b.set_defaults(fn=cmd_bench_swarm)


def _add_bench_offload(bench: Subparsers) -> None:
    o = bench.add_parser("offload", help="aggregate tok/s with 0 vs 1 pinned worker, per RTT")
    o.add_argument("--model", help="GGUF file (default: a generated 240 MB Q4_K model)")
    o.add_argument("--rtt-ms", type=_floats, default=(0.0,), help="comma list, e.g. 0,5,20,50")
    o.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="on a local N-master Redis Cluster (at --rtt-ms 0)",
    )
    o.add_argument(
        "--microbatches",
        type=_ints,
        default=(1,),
        help="comma list of KVQ_MICROBATCHES values run side by side, e.g. 1,2",
    )
    o.add_argument("--sequences", type=_positive, default=8, help="concurrent client loops")
    o.add_argument("--max-tokens", type=_positive, default=16, help="tokens per request")
    o.add_argument("--warmup-s", type=float, default=10.0, help="load before measuring")
    o.add_argument("--measure-s", type=float, default=30.0, help="measured window per run")
    o.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="rounds over the RTTs (and micro-batches), for medians",
    )
    o.add_argument("--log-dir", help="keep the processes' logs here")
    o.add_argument("--json", action="store_true", help="print JSON (for machines)")
    o.set_defaults(fn=cmd_bench_offload)


def _add_bench_microbatch(bench: Subparsers) -> None:
    m = bench.add_parser("microbatch", help="engine step time, 1 vs n micro-batches, paired")
    m.add_argument("--model", help="GGUF file (default: the offload bench's 240 MB model)")
    m.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added to the worker's")
    m.add_argument("--microbatches", type=_positive, default=2, help="the arm against 1")
    m.add_argument("--sequences", type=_positive, default=8, help="slots, all busy")
    m.add_argument("--max-tokens", type=_positive, default=48, help="tokens per sequence")
    m.add_argument("--warmup-steps", type=int, default=30, help="steps not measured")
    m.add_argument("--pairs", type=_positive, default=60, help="measured steps per arm")
    m.add_argument(
        "--policy",
        choices=("capacity", "copies"),
        default="capacity",
        help="KVQ_DISPATCH_POLICY (copies: the worker's slice goes remote in every layer)",
    )
    m.add_argument("--log-dir", help="keep the worker's log here")
    m.add_argument("--json", action="store_true", help="print JSON (for machines)")
    m.set_defaults(fn=cmd_bench_microbatch)
