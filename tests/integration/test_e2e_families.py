"""The swarm path for the newer families: a backbone-only coordinator (KVQ_COORDINATOR_EXPERTS
=none) and two `kvq worker` processes, each holding half of every MoE layer's routed experts,
give the same greedy tokens as all-local generation. The leading dense layer and the shared
experts stay with the coordinator; only routed experts travel (gpt-oss's with their biases,
three more stacked ranges per layer, and MXFP4 experts). qwen35moe's DeltaNet layers keep
their recurrent state per sequence in the coordinator, beside its KV cache; llama4's dense
layers between its MoE ones stay there too."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import local_tokens

from kvq import client
from kvq.bus import connect
from kvq.bus.redis_board import open_board
from kvq.config import child_env, load_settings
from kvq.gguf import read_meta
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("arch", "variant", "quant"),
    [
        ("deepseek2", "v3", "f32"),
        ("glm4moe", "", "f32"),
        ("gpt-oss", "", "mxfp4"),
        ("qwen35moe", "", "f32"),
        ("llama4", "", "f32"),  # MoE on every other layer: a slice takes layers 1, 3 (a step)
    ],
)
def test_backbone_only_coordinator_and_two_workers_equal_local_generation(
    redis_server,
    tmp_path: Path,
    arch: str,
    variant: str,
    quant: str,  # type: ignore[no-untyped-def]
) -> None:
    model = tmp_path / f"{arch}.gguf"
    make_tiny(model, arch=arch, variant=variant, layers=3, experts=8, seed=5, quant=quant)
    meta = read_meta(model)
    model_id = f"fam-{arch}"
    s = load_settings(
        redis_url=redis_server.url,
        prefix=f"fam-{arch}",
        coordinator_experts="none",
        slice_layers=len(meta.moe_layers),
        slice_experts=4,
        worker_max_slices=1,
        job_deadline_ms=60000,
    )
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        kids.spawn("monitor", "monitor", "--model", f"{model_id}={model}")
        kids.wait_for(lambda: model_id in board.models(), 120, "registration")
        info = board.model_info(model_id)
        assert len(info.slices) == 2  # every MoE layer, experts 0-3 and 4-7
        kinds = 6 if arch == "gpt-oss" else 3  # gpt-oss: the experts' biases travel too
        assert all(len(sl.ranges) == kinds * len(meta.moe_layers) for sl in info.slices.values())
        assert all(sl.layer_start == meta.moe_layers.start for sl in info.slices.values())
        for w in ("w0", "w1"):
            kids.spawn(w, "worker", "--id", w)

        def ready() -> set[str]:
            return {v.slice_id for v in board.workers(model_id) if v.alive and v.ready}

        kids.wait_for(lambda: ready() == set(info.slices), 300, "both halves held")
        kids.spawn(
            "coord", "coordinator", "--model", str(model), "--model-id", model_id, "--id", "c1"
        )
        kids.wait_for(lambda: board.coordinator_alive("c1"), 120, "the coordinator")
        r = connect(s.bus)
        try:
            prompt = "The quick brown fox"
            got = client.generate(
                r, Keys(s.prefix), model_id, prompt=prompt, max_tokens=8, timeout_s=240
            )
        finally:
            r.close()
        assert got == local_tokens(model, prompt, 8)
        # the coordinator publishes its counters every few seconds; it computed no expert
        kids.wait_for(lambda: board.coord_stats("c1").remote_jobs > 0, 60, "published stats")
        assert board.coord_stats("c1").local_jobs == 0
    finally:
        kids.stop_all()
