"""What a row of an offloaded prefill costs a worker against the coordinator's own call: one
512-token prompt's MoE layers (its real routing, captured from a forward pass), each computed
by the coordinator's `Backbone.local_moe` and by a worker's `ExpertServer.handle` on that
layer's downloaded bytes (`slice_layout` ranges read from the file, `decode_slice`, a `Bank`:
what `kvq.worker.loader.Loader.load` builds), the job's decoding and the result's encoding
included. Alternating, 6 rounds, the first not counted; medians. Prints one JSON document;
docs/benchmarks.md quotes its figures.

    python examples/remote_prefill_rows.py MODEL.gguf [LAYER ...]   (default: layers 0 and 2)
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.device import compute_dtype
from kvq.gguf import read_meta, slice_layout
from kvq.model import Backbone, decode_slice
from kvq.model.cache import SeqStep
from kvq.quant import kernels

ROWS = 512
ROUNDS = 6
OPTS = BankOptions(hot_bytes=0, numa_policy="off", vram_reserve_bytes=0, dynamic=False)


def _worker(path: Path, layer: int) -> ExpertServer:
    """A worker holding every expert of `layer`, from the file's bytes as a download gives them."""
    meta = read_meta(path)
    ranges = slice_layout(meta, layer, 0, meta.expert_count)
    with path.open("rb") as f:
        blobs = []
        for r in ranges:
            f.seek(r.offset)
            blobs.append(f.read(r.nbytes))
    dtype = compute_dtype(torch.device("cpu"), "auto", (r.ggml_type for r in ranges))
    part = decode_slice(ranges, blobs, layer, 0, meta.expert_count, dtype=dtype)
    return ExpertServer("w", "bench", Bank([part], OPTS, "cpu"), meta.embedding_length, dtype)


def main(path: Path, layers: list[int]) -> dict[str, object]:
    torch.set_num_threads(2)
    kernels.int8_active()  # build the kernel before any clock starts
    bb = Backbone.from_gguf(path)
    calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls[layer] = (x.clone(), ids.clone(), w.clone())
        return bb.local_moe(layer, x, ids, w)

    prompt = torch.randint(
        0, bb.meta.vocab_size, (ROWS,), generator=torch.Generator().manual_seed(0)
    )
    bb.forward([SeqStep(prompt.tolist(), bb.new_cache())], moe=record)
    out: dict[str, object] = {"model": str(path), "rows": ROWS, "threads": 2,
                              "paths": kernels.paths(), "layers": {}}  # fmt: skip
    for layer in layers:
        x, ids, w = calls[layer]
        server = _worker(path, layer)
        job = wire.Job(
            job_id="j", model="bench", layer=layer, slice="s", expert_start=0,
            expert_end=bb.meta.expert_count, coord="c", reply_to="out", deadline_ms=0,
            x=wire.Tensor.of(x.numpy()), ids=wire.Tensor.of(ids.numpy()),
            weights=wire.Tensor.of(w.numpy()),
        )  # fmt: skip
        local_s, worker_s = [], []
        for _ in range(ROUNDS):
            t = time.perf_counter()
            y = bb.local_moe(layer, x, ids, w)
            local_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            res = server.handle(job)
            worker_s.append(time.perf_counter() - t)
            if res.error is not None or res.y is None:
                raise SystemExit(f"layer {layer}: the worker answered {res.error}")
        loc, rem = statistics.median(local_s[1:]), statistics.median(worker_s[1:])
        out["layers"][str(layer)] = {  # type: ignore[index]
            "local_ms_per_row": round(loc / ROWS * 1e3, 4),
            "worker_ms_per_row": round(rem / ROWS * 1e3, 4),
            "worker_over_local": round(rem / loc, 3),
            "same_bits": bool(np.array_equal(res.y.array(), y.numpy())),
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    picked = [int(a) for a in sys.argv[2:]] or [0, 2]
    print(json.dumps(main(Path(sys.argv[1]), picked), indent=1))
