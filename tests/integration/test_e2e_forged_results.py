"""Issue 29 item 6: forged results with the DEFAULT verification settings (`KVQ_VERIFY_REMOTE`
sampled, the default trust schedule). A real worker process (`forger_worker.py`) answers each
of its jobs with a forged result (NaN, wrong values, or the wrong shape) and posts, beside it,
results for jobs it never got; an honest worker holds the other layer. The coordinator holds
no experts, so every expert job is remote. No wrong token may reach a client (every request's
tokens equal all-local generation; once the forger is barred its slice has no other worker and
requests are refused with the reason) and the forger is quarantined in Redis, where every
coordinator and the monitor read it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import local_tokens, wait_ready

from kvq import client
from kvq.config import Settings, child_env
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor import Monitor

pytestmark = pytest.mark.slow
FORGER = Path(__file__).with_name("forger_worker.py")
PROMPTS = ["forged results", "never used", "the quick brown fox", "kvq"]
MAX_TOKENS = 10


@pytest.fixture
def kids(settings: Settings, tmp_path: Path) -> Iterator[Children]:
    k = Children(child_env(settings), log_dir=str(tmp_path))
    yield k
    k.stop_all()


@pytest.mark.parametrize("kind", ["nan", "noise", "shape"])
def test_forged_results_never_reach_a_client_and_the_forger_is_quarantined(
    settings: Settings,
    kids: Children,
    run_in_thread,
    tiny_model: Path,
    tmp_path: Path,
    kind: str,
) -> None:
    s = settings.model_copy(
        update={
            "coordinator_experts": "none",
            "slice_experts": 8,
            "worker_max_slices": 1,
            "job_deadline_ms": 10_000,
        }
    )
    assert s.verify_remote == "sampled" and s.trust_full_checks == 50, "the defaults"
    kids.env = child_env(s)
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)
    with (tmp_path / "forger.log").open("wb") as out:
        kids.procs["forger"] = subprocess.Popen(
            [sys.executable, str(FORGER), "--id", "forger", "--kind", kind],
            env=kids.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    kids.wait_for(
        lambda: mon.board.assignments("tiny").get("forger") == (min(info.slices),),
        60,
        "the forger holding layer 0",
    )
    kids.spawn("honest", "worker", "--id", "honest")
    wait_ready(mon, "tiny", 2)
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    r, keys = mon.board.r, Keys(s.prefix)
    caught_at, refused = None, 0
    for n, prompt in enumerate(PROMPTS, start=1):
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=MAX_TOKENS)
        try:
            got = [e.token_id for e in client.events(r, keys, rid, 60) if e.token_id is not None]
        except client.RequestFailed as exc:
            # once the forger is barred its slice has no other worker: refused, with the reason
            assert caught_at is not None and "no live node holds" in str(exc), exc
            refused += 1
            continue
        assert got == local_tokens(tiny_model, prompt, MAX_TOKENS), (kind, prompt)
        if caught_at is None and "forger" in mon.board.quarantined("tiny"):
            caught_at = n
    assert caught_at == 1, "caught on its first forged result"
    verdict = mon.board.quarantined("tiny")["forger"]
    assert verdict.active(time.time() * 1000) and verdict.coord == "c1"
    forged = len(re.findall(r"FORGED job", (tmp_path / "forger.log").read_text()))
    st = coord.dispatch.stats
    assert forged >= 1 and st.quarantines >= 1
    assert st.late_results + st.foreign_results >= 1, "results for jobs it never got: dropped"
    assert coord.dispatch.per_worker.get("forger", 0) == 0, "none of its results used"
    print(
        f"{kind}: {forged} forged jobs, quarantined after request 1, {refused} requests refused "
        f"after; late/foreign results dropped {st.late_results}/{st.foreign_results}, "
        f"fallbacks {st.fallback_jobs}"
    )
