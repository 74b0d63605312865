"""Downloads that survive (issue 10 item 5), on a real Redis with a real monitor: a worker
downloading slowly heartbeats as "loading" with its progress, is never reaped for it, keeps
its reservation (the slice is not offered twice), is not routed to until it serves; a slice
that fails its checksum is retried with exponential back-off, not every poll."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.config import Settings
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny
from kvq.worker import Worker

CHUNK = 1536  # bytes per write of the slow server
PAUSE_S = 0.01  # after each chunk: ~150 KB/s


class _SlowRangeHandler(http.server.SimpleHTTPRequestHandler):
    """Single-range GETs, sent CHUNK bytes at a time with a pause between chunks."""

    def do_GET(self) -> None:  # http.server's naming
        data = Path(self.translate_path(self.path)).read_bytes()
        start, end = (int(p) for p in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(0, len(body), CHUNK):
            self.wfile.write(body[i : i + CHUNK])
            self.wfile.flush()
            time.sleep(PAUSE_S)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    # one slice of 8 experts 64x128 f32: ~0.8 MB, about 5 s from the slow server
    make_tiny(path, layers=1, experts=8, hidden=64, expert_ffn=128)
    return path


@pytest.fixture
def slow_url(model: Path) -> Iterator[str]:
    handler = functools.partial(_SlowRangeHandler, directory=str(model.parent))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/{model.name}"
    srv.shutdown()
    srv.server_close()


def test_slow_download_is_not_reaped_nor_offered_twice(
    settings: Settings, model: Path, slow_url: str, run_in_thread
) -> None:
    s = settings.model_copy(update={"slice_experts": 8, "base_replicas": 1})
    keys = Keys(s.prefix)
    monitor = Monitor.from_settings(s)
    info = monitor.register("m", model, source=slow_url)
    (sid,) = info.slices
    spec = info.slices[sid]
    assert spec.nbytes / (CHUNK / PAUSE_S) > 4 * s.heartbeat_ttl_s, "download must outlast TTLs"
    run_in_thread(monitor)
    slow = Worker.from_settings(s, "slow")
    run_in_thread(slow)
    board = monitor.board
    wait_for(lambda: (board.worker_info("slow") or _none).state == "loading", 20)
    other = Worker.from_settings(s, "other")  # would take the slice if it were offered again
    run_in_thread(other)
    progress: list[int] = []
    t0 = time.monotonic()
    while slow.holding is None:
        w = board.worker_info("slow")
        assert w is not None and w.state in ("loading", "serving"), w
        if w.state == "loading":
            progress.append(w.loaded_bytes)
            assert w.total_bytes == spec.nbytes or w.loaded_bytes == w.total_bytes == 0
        assert board.assignments("m") == {"slow": (sid,)}, "reaped, or the slice was offered twice"
        assert board.r.hget(keys.model_coverage("m"), sid) == b"1"
        if [v for v in board.workers("m") if v.ready]:  # it may have just finished loading
            assert slow.holding is not None, "routable before it serves"
        assert time.monotonic() - t0 < 30, "download did not finish"
        time.sleep(0.1)
    elapsed = time.monotonic() - t0
    assert elapsed > 3 * s.heartbeat_ttl_s, f"the download took only {elapsed:.1f}s"
    assert monitor.reaped == 0
    assert progress and progress[-1] > progress[0], f"no progress shown: {progress[:3]}…"
    wait_for(lambda: (board.worker_info("slow") or _none).state == "serving", 20)
    assert [v.worker_id for v in board.workers("m") if v.ready and v.alive] == ["slow"]
    assert other.holding is None and board.assignments("m") == {"slow": (sid,)}


def test_integrity_failure_backs_off(settings: Settings, model: Path, run_in_thread) -> None:
    s = settings.model_copy(
        update={"slice_experts": 8, "volunteer_poll_s": 0.05, "load_retry_max_s": 10.0}
    )
    monitor = Monitor.from_settings(s)
    info = monitor.register("m", model)
    (spec,) = info.slices.values()
    with open(model, "r+b") as f:  # the published checksums no longer match the file
        f.seek(spec.ranges[0].offset)
        f.write(b"\x00" * 64)
    worker = Worker.from_settings(s, "w")
    run_in_thread(worker)
    time.sleep(2.0)  # two seconds of load attempts, counted below
    tries = worker.volunteer.backoff.failures
    # every poll would be ~40 tries in 2 s; doubling from 0.05 s (with jitter) gives 5 to 8
    assert 2 <= tries <= 8, f"{tries} load attempts in 2 s"
    assert worker.holding is None
    assert monitor.board.assignments("m") == {}, "the slice went back to the market"


def test_a_tampered_source_is_downloaded_once_and_said_once(
    settings: Settings,
    model: Path,
    run_in_thread,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same source gives the same bad bytes: offered the slice again, the worker gives it
    back without downloading it, and the error line is written once."""
    import kvq.worker.loader as loader

    s = settings.model_copy(
        update={"slice_experts": 8, "volunteer_poll_s": 0.02, "load_retry_max_s": 0.1}
    )
    monitor = Monitor.from_settings(s)
    (spec,) = monitor.register("m", model).slices.values()
    with open(model, "r+b") as f:
        f.seek(spec.ranges[0].offset)
        f.write(b"\x00" * 64)
    fetches = []
    real = loader.fetch_slice
    monkeypatch.setattr(loader, "fetch_slice", lambda *a: fetches.append(1) or real(*a))
    worker = Worker.from_settings(s, "w")
    with caplog.at_level("DEBUG", logger="kvq.worker"):
        run_in_thread(worker)
        wait_for(lambda: worker.volunteer.backoff.failures >= 6, 20)
    assert len(fetches) == 1, f"{len(fetches)} downloads of a slice whose bytes are known bad"
    said = [r for r in caplog.records if "not downloading it from there again" in r.message]
    assert len(said) == 1 and said[0].levelname == "ERROR"
    assert worker.holding is None and monitor.board.assignments("m") == {}


class _None:
    state = None


_none = _None()
