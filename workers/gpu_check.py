"""GPU check of the hot/cold bank, run by `workers/gpu_check.sh` (B8: figures measured here).

A script for a CUDA machine, not part of the library: it needs the repository checkout (it runs
`tests/bank` from it) and kvq importable (the shell wrapper puts the checkout on PYTHONPATH).

1. The bank tests on the GPU (`BANK_TEST_DEVICE=cuda pytest tests/bank`).
2. Device-to-device and host-to-device (pinned) copy bandwidth, measured by this run.
3. Expert throughput of a Bank with every expert hot, then every expert cold, read in place
   (mapped) and staged: the GB/s of expert weights the compute consumes, next to (2).
Without CUDA it prints why and exits 0. Meant to finish in well under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

GB = 1e9


def _cuda_seconds(fn: Any, reps: int) -> float:
    """Median seconds of `fn()` on the current stream, timed with CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(
    device: torch.device, nbytes: int = 512 << 20, reps: int = 5
) -> dict[str, float]:
    """GB/s of device-to-device and pinned host-to-device copies of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d2d = _cuda_seconds(lambda: dst.copy_(src), reps)
    h2d = _cuda_seconds(lambda: dst.copy_(host, non_blocking=True), reps)
    return {"d2d_gbps": nbytes / d2d / GB, "h2d_gbps": nbytes / h2d / GB}


def expert_throughput(
    device: torch.device, hidden: int = 2048, ffn: int = 768, experts: int = 32, tokens: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per mode (hot, mapped, staged): expert calls/s and weight GB/s for `tokens` tokens
    routed to one expert per call, sweeping every expert (Qwen3-30B-A3B-sized by default)."""
    from kvq.bank import Bank, BankOptions
    from kvq.model.expert_slice import ExpertSlice

    g = torch.randn(experts, ffn, hidden, dtype=dtype) * 0.02
    sl = ExpertSlice(0, 0, experts, g, g.clone(), torch.randn(experts, hidden, ffn, dtype=dtype))
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)  # [T, H]
    w = torch.ones(tokens, 1, device=device, dtype=dtype)  # [T, 1]
    ids = [torch.full((tokens, 1), e, dtype=torch.int64, device=device) for e in range(experts)]
    out: dict[str, dict[str, float]] = {}
    for mode, hot, path in (("hot", None, "mapped"), ("mapped", 0, "mapped"),
                            ("staged", 0, "staged")):  # fmt: skip
        opts = BankOptions(hot_bytes=hot, vram_reserve_bytes=0, numa_policy="off",
                           cold_path=path, dynamic=False)  # fmt: skip
        bank = Bank([sl], opts, device)

        def sweep(bank: Bank = bank) -> None:
            for i in ids:
                bank.forward(0, x, i, w)

        secs = _cuda_seconds(sweep, 3)
        per_expert = 3 * hidden * ffn * g.element_size()
        out[mode] = {"expert_calls_per_s": experts / secs,
                     "weight_gbps": experts * per_expert / secs / GB}  # fmt: skip
        del bank
    return out


def quantized_experts(
    device: torch.device, hidden: int = 2048, ffn: int = 768, experts: int = 16, tokens: int = 8,
    quants: tuple[str, ...] = ("q4_k", "q6_k", "q8_0"),
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per quant type and mode (hot, mapped, staged): expert calls/s, quantized GB/s crossing
    PCIe, and the max error against the CPU computing the same experts (float32 on both)."""
    import numpy as np

    from kvq.bank import Bank, BankOptions
    from kvq.model.expert_slice import ExpertSlice
    from kvq.model.qstack import QStack
    from kvq.tools.synth.quants import encode, quant_type_named

    rng = np.random.default_rng(0)
    x = torch.randn(tokens, hidden)  # [T, H]
    w = torch.ones(tokens, 1)  # [T, 1]
    ids = [torch.full((tokens, 1), e, dtype=torch.int64) for e in range(experts)]
    out: dict[str, dict[str, float]] = {}
    for quant in quants:
        qtype = int(quant_type_named(quant))
        stacks = []
        for rows, cols in ((ffn, hidden), (ffn, hidden), (hidden, ffn)):
            data = rng.standard_normal((experts, rows, cols), dtype=np.float32) * 0.02
            raw = torch.from_numpy(encode(data, qtype).reshape(experts, -1).copy())
            stacks.append(QStack(raw, qtype, (experts, rows, cols)))
        sl = ExpertSlice(0, 0, experts, *stacks, torch.float32)
        cpu = Bank([sl], BankOptions(hot_bytes=0, numa_policy="off", dynamic=False), "cpu")
        want = [cpu.forward(0, x, i, w) for i in ids]
        for mode, hot, path in (("hot", None, "mapped"), ("mapped", 0, "mapped"),
                                ("staged", 0, "staged")):  # fmt: skip
            opts = BankOptions(hot_bytes=hot, vram_reserve_bytes=0, numa_policy="off",
                               cold_path=path, dynamic=False)  # fmt: skip
            bank = Bank([sl], opts, device)
            xd, wd, idd = x.to(device), w.to(device), [i.to(device) for i in ids]
            got = [bank.forward(0, xd, i, wd).cpu() for i in idd]
            err = max(float((g - r).abs().max()) for g, r in zip(got, want, strict=True))

            def sweep(
                bank: Bank = bank, xd: torch.Tensor = xd, wd: torch.Tensor = wd,
                idd: list[torch.Tensor] = idd,
            ) -> None:  # fmt: skip
                for i in idd:
                    bank.forward(0, xd, i, wd)

            secs = _cuda_seconds(sweep, 3)
            qbytes = sum(t.expert_nbytes for t in stacks)
            out[f"{quant}/{mode}"] = {"expert_calls_per_s": experts / secs,
                                      "quantized_gbps": experts * qbytes / secs / GB,
                                      "max_abs_err_vs_cpu": err}  # fmt: skip
            del bank
    return out


def run_tests(root: Path, timeout_s: float) -> int:
    """The bank tests on CUDA; their exit code (124 on timeout)."""
    env = os.environ | {"BANK_TEST_DEVICE": "cuda"}
    cmd = [sys.executable, "-m", "pytest", "tests/bank", "tests/quant", "-q", "-p",
           "no:cacheprovider"]  # fmt: skip
    try:
        return subprocess.run(cmd, cwd=root, env=env, timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"gpu_check: bank tests did not finish in {timeout_s:.0f}s", file=sys.stderr)
        return 124


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_check", description=__doc__.split("\n")[0] if __doc__ else None
    )
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests-timeout", type=float, default=180.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}); nothing to check. Run it on a machine with a GPU.")  # fmt: skip
        return 0
    device = torch.device("cuda")
    t0 = time.monotonic()
    root = Path(__file__).resolve().parents[1]
    rc = 0 if args.skip_tests else run_tests(root, args.tests_timeout)
    result = {"device": torch.cuda.get_device_name(device), "tests_rc": rc,
              **copy_bandwidth(device), "experts": expert_throughput(device),
              "quantized": quantized_experts(device)}  # fmt: skip
    result["seconds"] = time.monotonic() - t0
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0 if rc == 0 else 1


def _print(r: dict[str, Any]) -> None:
    print(f"device {r['device']}; bank tests exit code {r['tests_rc']}")
    print(f"copy bandwidth: device-to-device {r['d2d_gbps']:.1f} GB/s, "
          f"host-to-device (pinned) {r['h2d_gbps']:.1f} GB/s")  # fmt: skip
    for mode, m in r["experts"].items():
        print(f"experts {mode:<7} {m['expert_calls_per_s']:>10.0f} calls/s "
              f"{m['weight_gbps']:>8.1f} GB/s of weights")  # fmt: skip
    for key, m in r["quantized"].items():
        print(f"quantized {key:<14} {m['expert_calls_per_s']:>10.0f} calls/s "
              f"{m['quantized_gbps']:>8.2f} GB/s of quantized bytes, "
              f"max |err| vs CPU {m['max_abs_err_vs_cpu']:.2e}")  # fmt: skip
    print(f"done in {r['seconds']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
