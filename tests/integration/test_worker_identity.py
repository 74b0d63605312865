"""Bound identities: one live process per worker id, a worker user serves only its own id, and
market asks are answered for the worker whose key they were found in."""

from __future__ import annotations

import json
import time

import pytest
import redis
from acl_helpers import RoleSettings
from e2e_helpers import wait_for

from kvq.bus.market import MarketDesk, MarketDoor
from kvq.bus.records import Quarantine
from kvq.bus.redis_board import open_board
from kvq.config import Settings
from kvq.errors import ConfigError, IdentityInUse
from kvq.keys import Keys
from kvq.worker import Worker


def test_a_second_live_worker_with_the_same_id_is_refused(
    settings: Settings, run_in_thread
) -> None:
    first = Worker.from_settings(settings, "dup")
    run_in_thread(first)
    board = open_board(settings.bus, settings.lifetimes)
    wait_for(lambda: board.worker_alive("dup"), what="the first worker's beat")
    second = Worker.from_settings(settings, "dup")
    with pytest.raises(IdentityInUse, match="in use"):
        second.run()
    assert board.worker_instance("dup") == first.membership.instance, "the first one keeps it"
    board.r.close()
    second.board.r.close()


def test_a_restarted_worker_takes_its_id_back_once_the_old_beat_lapses(settings: Settings) -> None:
    board = open_board(settings.bus, settings.lifetimes)
    assert board.claim_worker("again", "crashed-process")  # it died without leaving
    w = Worker.from_settings(settings, "again")
    w.membership.claim(settings.lifetimes.claim_wait_s())  # waits out the old TTL
    assert board.worker_instance("again") == w.membership.instance
    board.r.close()
    w.board.r.close()


def test_the_monitor_refuses_an_ask_from_another_process_of_a_live_id(
    settings: Settings, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    board = open_board(settings.bus, settings.lifetimes)
    assert board.claim_worker("w", "live-one")
    desk = MarketDesk(board, board.r, keys, 1000)
    r.xadd(keys.worker_asks("w"), {"op": "volunteer", "instance": "impostor", "nonce": "n1"})
    r.xadd(keys.market(), {"worker": "w"})
    assert desk.serve(block_ms=None) == 1
    ((_, answer),) = r.xrange(keys.worker_answers("w"))
    assert answer[b"in_use"] == b"1" and desk.refused == 1
    board.r.close()


def test_a_door_without_a_monitor_gives_up_after_its_wait(
    settings: Settings, r: redis.Redis
) -> None:
    door = MarketDoor(r, Keys(settings.prefix), "i", wait_s=0.2, maxlen=1000)
    assert door.volunteer("lonely") is None


def test_a_forged_doorbell_is_ignored(settings: Settings, r: redis.Redis) -> None:
    keys = Keys(settings.prefix)
    board = open_board(settings.bus, settings.lifetimes)
    desk = MarketDesk(board, board.r, keys, 1000)
    r.xadd(keys.market(), {"worker": "no*such}id"})
    r.xadd(keys.market(), {"worker": "nobody"})  # rang, but asked nothing
    assert desk.serve(block_ms=None) == 0
    board.r.close()


def test_a_worker_user_serves_only_its_own_id(settings: Settings, as_role: RoleSettings) -> None:
    s = as_role("worker", "a")
    with pytest.raises(ConfigError, match="needs the user"):
        Worker.from_settings(s, "b")
    w = Worker.from_settings(s, "a")
    w.board.r.close()


@pytest.mark.parametrize("bad", ["a*", "a}", "{w:b}", "a:b", "x" * 65, "", "a b", "a?"])
def test_worker_ids_are_limited_to_acl_safe_characters(settings: Settings, bad: str) -> None:
    with pytest.raises(ConfigError, match="not allowed"):
        Worker.from_settings(settings, bad)


def test_a_rejoin_claims_back_only_granted_or_wanted_slices(
    settings: Settings, r: redis.Redis, tiny_model
) -> None:
    """Issue 32: a worker that holds nothing asked `rejoin` for every slice and was listed
    beside every holder (fake coverage). The desk takes a rejoin only for slices it granted
    that worker, or that are still wanted (target above coverage)."""
    from kvq.monitor import Monitor

    keys = Keys(settings.prefix)
    mon = Monitor.from_settings(settings)
    info = mon.register("tiny", tiny_model)
    board = open_board(settings.bus, settings.lifetimes)
    desk = MarketDesk(board, board.r, keys, 1000)
    sids = sorted(info.slices)

    def ask(worker: str, op: str, sid: str = "") -> dict[bytes, bytes]:
        held = json.dumps({"tiny": list(board.held_by("tiny", worker))})
        r.xadd(
            keys.worker_asks(worker),
            {
                "op": op,
                "instance": "",
                "nonce": op + sid,
                "model": "tiny",
                "slice": sid,
                "held": held,
            },
        )
        r.xadd(keys.market(), {"worker": worker})
        desk.serve(block_ms=None)
        return r.xrange(keys.worker_answers(worker))[-1][1]

    for _ in sids:  # an honest worker covers every slice (base target 1) through the desk
        assert ask("honest", "volunteer")[b"slice"]
    assert all(d.coverage >= d.target for d in board.slice_demand("tiny").values()), (
        board.slice_demand("tiny"),
        board.held_by("tiny", "honest"),
    )
    # a worker that got nothing claims every slice back: refused, listed nowhere
    got = ask("faker", "rejoin", ",".join(sids))
    assert b"refused" in got[b"error"] and board.held_by("tiny", "faker") == ()
    # the honest one, reaped (its slices released) and back after the monitor restarted (a
    # new desk): it takes back what it was granted, from the grant record in Redis
    board.release("tiny", "honest")
    desk = MarketDesk(board, board.r, keys, 1000)
    assert desk.granted("tiny", "honest") == set(sids) and desk.granted("tiny", "faker") == set()
    got = ask("honest", "rejoin", ",".join(sids))
    assert got[b"slice"].decode().split(",") == sids and board.held_by("tiny", "honest") == tuple(
        sids
    )
    # a slice still wanted may be claimed as a volunteer would get it
    board.release("tiny", "honest", sids[0])
    assert ask("faker", "rejoin", sids[0])[b"slice"].decode() == sids[0]
    # caught lying: it takes nothing back, and is offered nothing, while its verdict lasts
    until = int(time.time() * 1000) + 600_000
    board.quarantine("tiny", "honest", Quarantine(until_ms=until, mismatches=1, coord="c1"))
    board.release("tiny", "honest")
    got = ask("honest", "rejoin", ",".join(sids))
    assert b"quarantined" in got[b"error"] and board.held_by("tiny", "honest") == ()
    assert ask("honest", "volunteer")[b"slice"] == b"" and board.held_by("tiny", "honest") == ()
    board.r.close()
    mon.board.r.close()
