"""`kvq bench llama-rpc`: llama.cpp's own way to spread a model over machines, on the same
emulated machines as `kvq bench pool`, as the peer the stage grain is measured against (X12).

llama.cpp's RPC backend splits a model's layers over `ggml-rpc-server` processes; the host
(`llama-batched-bench --rpc`) sends each its layers' work every token. Per `--rtt-ms` value this
starts `servers` servers on loopback (one CPU thread each, on the second CPU), each behind a
`DelayProxy` adding that round trip, and runs `llama-batched-bench` on the first CPU with one
thread, the layers split evenly (`-ts 1/1/...`), `-npp` prompt and `-npl` parallel sequences of
`-ntg` tokens each. The binaries come from llama.cpp's tree built with `-DGGML_RPC=ON` (the
llama-cpp-python sdist's `vendor/llama.cpp`: docs/benchmarks.md says how); without them the
report says so and nothing runs.

Each run's `tok_s` is batched-bench's generation rate (`speed_tg`: sequences x generated tokens
/ generation time), the figure `kvq bench pool` reports as `tok_s`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.errors import ConfigError

from .delay_proxy import DelayProxy

SERVER, BATCHED = "ggml-rpc-server", "llama-batched-bench"


@dataclass(frozen=True)
class RpcBench:
    model: str
    bin_dir: str
    servers: int = 3
    rtts_ms: tuple[float, ...] = (0.0, 5.0, 20.0)
    sequences: tuple[int, ...] = (1, 8)
    prompt_tokens: int = 16
    gen_tokens: int = 16
    timeout_s: float = 900.0


def find_binaries(bin_dir: str) -> tuple[Path, Path] | None:
    """The two binaries under `bin_dir` (searched recursively, or on PATH), or None."""
    found = []
    for name in (SERVER, BATCHED):
        hits = sorted(Path(bin_dir).expanduser().rglob(name)) if bin_dir else []
        path = next((p for p in hits if os.access(p, os.X_OK)), None)
        if path is None and shutil.which(name):
            path = Path(str(shutil.which(name)))
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def run_rpc_bench(cfg: RpcBench) -> dict[str, Any]:
    """{"runs": [{"rtt_ms", "sequences", "tok_s", "pp_tok_s"}, ...]} or {"skipped": why}."""
    if not Path(cfg.model).is_file():
        raise ConfigError(f"--model {cfg.model!r} is not a file")
    bins = find_binaries(cfg.bin_dir)
    if bins is None:
        return {
            "skipped": f"no {SERVER} and {BATCHED} under {cfg.bin_dir!r} or on PATH: build "
            "llama.cpp with -DGGML_RPC=ON (docs/benchmarks.md)"
        }
    cpus = sorted(os.sched_getaffinity(0))
    host_cpu, side_cpu = cpus[0], cpus[-1]
    runs: list[dict[str, Any]] = []
    for rtt in cfg.rtts_ms:
        runs.extend(_one_rtt(cfg, bins, rtt, host_cpu, side_cpu))
    return {
        "model": cfg.model,
        "servers": cfg.servers,
        "prompt_tokens": cfg.prompt_tokens,
        "gen_tokens": cfg.gen_tokens,
        "cpus": {"host": host_cpu, "servers_proxies": side_cpu},
        "threads": 1,
        "runs": runs,
    }


def _one_rtt(
    cfg: RpcBench, bins: tuple[Path, Path], rtt: float, host_cpu: int, side_cpu: int
) -> list[dict[str, Any]]:
    server_bin, batched_bin = bins
    procs: list[subprocess.Popen[bytes]] = []
    proxies: list[DelayProxy] = []
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {side_cpu})  # the proxies' threads run beside the servers
    try:
        for _ in range(cfg.servers):
            port = _free_port()
            server = f"taskset -c {side_cpu} {server_bin} -H 127.0.0.1 -p {port} -t 1"
            procs.append(
                subprocess.Popen(
                    server.split(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            _wait_port(port)
            proxies.append(DelayProxy("127.0.0.1", port, rtt))
        rpc = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
        out = subprocess.run(
            _batched(cfg, batched_bin, rpc, host_cpu),
            capture_output=True,
            text=True,
            timeout=cfg.timeout_s,
        )
        text = out.stdout + "\n" + out.stderr  # its LOG lines go to either, by build
        rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
        if out.returncode != 0 or not rows:
            tail = (out.stderr or out.stdout)[-400:]
            return [{"rtt_ms": rtt, "error": f"exit {out.returncode}: {tail}"}]
        return [
            {
                "rtt_ms": rtt,
                "sequences": r["pl"],
                "tok_s": round(r["speed_tg"], 3),
                "pp_tok_s": round(r["speed_pp"], 3),
            }
            for r in rows
        ]
    finally:
        os.sched_setaffinity(0, mine)
        for p in proxies:
            p.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def _batched(cfg: RpcBench, binary: Path, rpc: str, cpu: int) -> list[str]:
    """llama-batched-bench over the RPC servers `rpc`, one thread on `cpu`, layers split evenly."""
    context = max(cfg.sequences) * (cfg.prompt_tokens + cfg.gen_tokens) + 64
    return [
        "taskset",
        "-c",
        str(cpu),
        str(binary),
        "-m",
        cfg.model,
        "--rpc",
        rpc,
        "-ngl",
        "99",
        "-ts",
        "/".join("1" * cfg.servers),
        "-t",
        "1",
        "-npp",
        str(cfg.prompt_tokens),
        "-ntg",
        str(cfg.gen_tokens),
        "-npl",
        ",".join(str(n) for n in cfg.sequences),
        "-c",
        str(context),
        "--output-format",
        "jsonl",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{SERVER} did not listen on port {port} in {timeout_s:g} s")
