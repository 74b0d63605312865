"""What one stage job costs beyond its compute: a stage-grain model on real processes, its
workers reaching Redis through a `DelayProxy` on loopback (no namespaces, no cgroups), and the
mean job round trip the coordinator measured over one 30-token generation.

    python examples/stage_hop.py [RTT_MS] [MODEL.gguf] [STAGE_LAYERS] [WORKERS]

Defaults: 20 ms, a tiny olmoe model written to /tmp/kvq-stage-hop, 2 blocks a stage, 2 workers
(`KVQ_WORKER_MAX_SLICES=1`: one span each). On the development VM a tiny model's job took 2.8 ms
at 0 ms and 26.5 ms at 20 ms (1.2 RTT); the OLMoE-shaped preset (3 workers, 6 blocks a stage,
every process on one CPU) 58.4 ms at 20 ms, of which about 38 ms compute. `kvq bench pool
--grain stage` measured 79.6 ms at 20 ms for the same model (`docs/benchmarks.md`): the
sandbox's namespaces, cgroups and shared CPU cost about one more RTT a job.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvq import client
from kvq.bus import connect
from kvq.bus.histogram import Histogram
from kvq.bus.redis_board import open_board
from kvq.config import child_env, load_settings
from kvq.keys import Keys
from kvq.local.cluster import local_redis
from kvq.local.procs import Children
from kvq.tools.bench.delay_proxy import DelayProxy
from kvq.tools.synth import make_tiny


def main() -> None:
    rtt = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    work = Path("/tmp/kvq-stage-hop")
    work.mkdir(exist_ok=True)
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else work / "olmoe.gguf"
    if not model.exists():
        make_tiny(model, arch="olmoe", layers=4, experts=8, seed=1)
    stage_layers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    workers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    with local_redis() as srv:
        host, port = srv.url.split("//")[1].split("/")[0].split(":")
        proxy = DelayProxy(host, int(port), rtt)
        s = load_settings(
            redis_url=srv.url,
            prefix="hop",
            grain="stage",
            n_slots=4,
            stage_layers=stage_layers,
            worker_max_slices=1,
        )
        kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(work))
        board = open_board(s.bus, s.lifetimes)
        try:
            kids.spawn("monitor", "monitor", "--model", f"m={model}")
            kids.wait_for(lambda: "m" in board.models(), 600, "registration")
            far = kids.env | {"KVQ_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"}
            for i in range(workers):
                kids.spawn(f"w{i}", "worker", "--id", f"w{i}", env=far)
            info = board.model_info("m")
            assert info is not None
            kids.wait_for(
                lambda: {v.slice_id for v in board.workers("m") if v.ready} == set(info.slices),
                600,
                "every span held",
            )
            kids.spawn("c", "coordinator", "--model", str(model), "--model-id", "m", "--id", "c1")
            kids.wait_for(lambda: board.coordinator_alive("c1"), 600, "the coordinator")
            r = connect(s.bus)
            client.generate(r, Keys(s.prefix), "m", prompt="hi", max_tokens=4, timeout_s=600)
            st0 = board.coord_stats("c1")
            t0 = time.monotonic()
            got = client.generate(
                r, Keys(s.prefix), "m", prompt="hello", max_tokens=30, timeout_s=600
            )
            dt = time.monotonic() - t0
            kids.wait_for(lambda: board.coord_stats("c1") != st0, 30, "published stats")
            st1 = board.coord_stats("c1")
            assert st0 is not None and st1 is not None
            h0, h1 = Histogram.from_text(st0.job_rtt_s), Histogram.from_text(st1.job_rtt_s)
            assert h0 is not None and h1 is not None
            n = h1.count - h0.count
            print(
                f"rtt {rtt:g} ms: {len(got) / dt:.2f} tok/s, {n} stage jobs, mean job round "
                f"trip {1000 * (h1.sum - h0.sum) / max(n, 1):.1f} ms"
            )
        finally:
            kids.stop_all()
            proxy.close()


if __name__ == "__main__":
    main()
