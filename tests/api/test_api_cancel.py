"""Cancellation: a client that goes away mid-stream, or an interrupted `kvq submit`, cancels
its request, and the coordinator frees the slot within one step."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from conftest import MODEL, System
from waiting import wait_for

from kvq import client, wire
from kvq.config import child_env
from kvq.coordinator import Coordinator

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


def done_event(system: System, request_id: str) -> wire.ReplyEvent:
    key = system.keys.request_reply(request_id)
    evs = [wire.decode(f, wire.ReplyEvent) for _, f in system.r.xrange(key)]
    (done,) = [e for e in evs if e.kind == "done"]
    return done


def cancelled_ids(system: System) -> list[str]:
    entries = system.r.xrange(system.keys.model_cancels(MODEL))
    return [wire.decode(f, wire.Cancel).request_id for _, f in entries]


def test_disconnect_mid_stream_cancels(system: System) -> None:
    before = system.coord.replies.cancelled
    body = {
        "model": MODEL,
        "prompt": "a long story",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", system.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = first.split('"id":"cmpl-', 1)[1].split('"', 1)[0]
        for _ in range(3):
            next(lines)
    # the client is gone: the gateway cancels, the coordinator drops the sequence
    wait_for(lambda: rid in cancelled_ids(system), 20, "the cancel")
    wait_for(lambda: system.coord.replies.cancelled == before + 1, 20, "the coordinator to drop it")
    assert all(s.request_id != rid for s in system.coord.engine.active)
    done = wait_for(lambda: done_event(system, rid), 20, "its last event")
    assert done.finish == "cancelled" and done.index < 400
    wait_for(lambda: system.queued() == 0, 20, "the request acknowledged")


def test_interrupted_submit_cancels(system: System) -> None:
    before = system.coord.replies.cancelled
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvq",
            "submit",
            "--model",
            MODEL,
            "--prompt",
            "go on",
            "--max-tokens",
            "450",
        ],
        env=child_env(system.settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: system.coord.engine.busy > 0, 60, "the request to be generated")
        rid = system.coord.engine.active[0].request_id
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: system.coord.replies.cancelled == before + 1, 20, "the coordinator to drop it")
    assert rid in cancelled_ids(system)
    assert done_event(system, rid).index < 450


def test_the_slot_is_free_after_one_step(system: System) -> None:
    """Driven tick by tick: the tick after the cancel is written has dropped the sequence,
    while the other one goes on."""
    system.mon.register("manual", system.model_path)
    coord = Coordinator.from_settings(system.settings, "c-manual", "manual", system.model_path)
    try:
        r, keys = system.r, system.keys
        a = client.send(r, keys, "manual", prompt="one", max_tokens=100)
        b = client.send(r, keys, "manual", prompt="two", max_tokens=100)
        coord.tick()  # admits both, one step
        coord.tick()
        assert {s.request_id for s in coord.engine.active} == {a, b}
        made = len(coord.engine.active[0].generated)
        client.cancel(r, keys, "manual", a)
        coord.tick()
        assert [s.request_id for s in coord.engine.active] == [b]
        assert coord.engine.free == system.settings.n_slots - 1
        assert len(coord.engine.active[0].generated) == made + 1, "b stepped meanwhile"
        assert done_event(system, a).finish == "cancelled"
        # a request cancelled while still queued is refused when it is read
        c = client.send(r, keys, "manual", prompt="three", max_tokens=100)
        client.cancel(r, keys, "manual", c)
        coord.tick()
        assert [s.request_id for s in coord.engine.active] == [b]
        events = [wire.decode(f, wire.ReplyEvent) for _, f in r.xrange(keys.request_reply(c))]
        assert [e.kind for e in events] == ["error"]
    finally:
        coord.board.r.close()  # never run(): no slot-poll thread to stop


def _stream_then_leave(url: str, prompt: str, lines: int) -> None:
    """A streamed completion whose client leaves after `lines` lines (0: at the headers)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        it = resp.iter_lines()
        for _ in range(lines):
            next(it)


def _outcomes(system: System) -> dict[str, str]:
    """Every reply stream of the module's requests: request id -> how it ended."""
    out = {}
    for key in system.r.scan_iter(f"{system.keys.prefix}:{{r:*}}:reply", count=1000):
        evs = [wire.decode(f, wire.ReplyEvent) for _, f in system.r.xrange(key)]
        last = next((e for e in reversed(evs) if e.kind in ("done", "error")), None)
        rid = key.decode().split("{r:", 1)[1].split("}", 1)[0]
        why = last.error.message if last is not None and last.error is not None else ""
        out[rid] = "open" if last is None else f"{last.finish or last.kind}: {why}"
    return out


def test_every_client_that_leaves_has_its_request_cancelled(system: System) -> None:
    """X8: 48 streams at once on 4 slots, each client leaving at its headers (still queued),
    after its first line, or mid-stream: every request ends cancelled (refused before it
    started, or dropped mid-generation), none is generated to its end, and the queue empties."""
    import threading

    before = set(_outcomes(system))
    leave = [0, 1, 4] * 16
    threads = [
        threading.Thread(target=_stream_then_leave, args=(system.url, f"client {i}", n))
        for i, n in enumerate(leave)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wait_for(
        lambda: system.queued() == 0 and not system.coord.engine.active, 60, "every request gone"
    )
    ended = {rid: how for rid, how in _outcomes(system).items() if rid not in before}
    assert len(ended) == len(leave)
    missed = {rid: how for rid, how in ended.items() if "cancel" not in how}
    assert missed == {}, missed
