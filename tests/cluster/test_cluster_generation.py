"""Issue 14 on a real 3-master cluster: remote generation equals local generation."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import local_tokens, wait_for

from kvq import client
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.worker import Worker

pytestmark = pytest.mark.slow
PROMPTS = ["hello world", "the quick brown fox", "MoE experts over Redis", "kvq"]


def test_remote_generation_equals_local_on_a_cluster(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    s = settings.model_copy(update={
        "saturation_threshold": 1, "job_deadline_ms": 10_000, "dispatch_policy": "copies",
    })  # fmt: skip
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)
    run_in_thread(mon)
    workers = [Worker.from_settings(s, f"w{i}") for i in range(len(info.slices))]
    for w in workers:
        run_in_thread(w)
    wait_for(lambda: all(w.holding for w in workers), what="coverage (every worker loaded)")
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    subs = [client.submit(mon.board.r, keys, "tiny", prompt=p, max_tokens=12) for p in PROMPTS]
    for (rid, entry), prompt in zip(subs, PROMPTS, strict=True):
        got = [e.token_id for e in client.events(mon.board.r, keys, rid, 60, entry)
               if e.token_id is not None]  # fmt: skip
        assert got == local_tokens(tiny_model, prompt, 12), prompt
    st = coord.dispatch.stats
    assert st.remote_jobs > 0 and st.fallback_jobs == 0 and st.remote_errors == 0
    assert all(w.served > 0 for w in workers), "every slice's worker took part"
