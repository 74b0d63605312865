"""`kvq deadletter` against a real server: list, show, requeue to the source stream, purge."""

from __future__ import annotations

import json

import pytest
import redis

from kvq.bus import dead_letter
from kvq.bus.deadletters import get_dead, list_dead, purge, requeue
from kvq.cli import main
from kvq.config import Settings
from kvq.keys import Keys


def _park(r: redis.Redis, keys: Keys) -> tuple[str, str]:
    a, b = keys.model_requests("m"), keys.worker_inbox("w")
    dead_letter(r, keys, a, b"1-1", {b"v": b"1", b"blob": b"\xff\x00"}, "version 9", 1000)
    dead_letter(r, keys, b, b"2-1", {b"v": b"1", b"job": b"x"}, "not this slice", 1000)
    dead_letter(r, keys, a, b"3-1", {b"v": b"1", b"max_tokens": b"0"}, "max_tokens 0", 1000)
    return a, b


def test_list_show_requeue_purge(settings: Settings) -> None:
    r, keys = redis.Redis.from_url(settings.redis_url), Keys(settings.prefix)
    try:
        requests, inbox = _park(r, keys)
        letters = list_dead(r, keys, 10)
        assert [d.reason for d in letters] == ["max_tokens 0", "not this slice", "version 9"]
        assert [d.reason for d in list_dead(r, keys, 10, source=requests)] == [
            "max_tokens 0",
            "version 9",
        ]
        assert len(list_dead(r, keys, 2)) == 2
        first = letters[-1]
        shown = get_dead(r, keys, first.id)
        assert shown is not None and shown.fields == {b"v": b"1", b"blob": b"\xff\x00"}
        assert shown.describe()["fields"] == {"v": "1", "blob": "<2 bytes>"}
        assert get_dead(r, keys, "1-0") is None
        (done,) = requeue(r, keys, [letters[1].id, "1-0"], 1000)  # the unknown id is skipped
        assert done[0] == letters[1].id
        (entry,) = r.xrange(inbox)
        assert entry[1] == {b"v": b"1", b"job": b"x"}, "the original fields, in its source"
        assert len(list_dead(r, keys, 10)) == 2
        assert purge(r, keys, [letters[0].id]) == 1
        assert purge(r, keys) == 1 and list_dead(r, keys, 10) == []
    finally:
        r.close()


def test_cli(settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("KVQ_PREFIX", settings.prefix)
    r, keys = redis.Redis.from_url(settings.redis_url), Keys(settings.prefix)
    try:
        _park(r, keys)
        assert main(["deadletter", "list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [d["reason"] for d in listed] == ["max_tokens 0", "not this slice", "version 9"]
        assert main(["deadletter", "show", listed[0]["id"], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["fields"]["max_tokens"] == "0"
        assert main(["deadletter", "show", "1-0"]) == 1
        capsys.readouterr()
        assert main(["deadletter", "requeue"]) == 2, "ids or --all"
        capsys.readouterr()
        assert main(["deadletter", "requeue", listed[0]["id"], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["id"] == listed[0]["id"]
        assert main(["deadletter", "purge", "--all", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"purged": 2}
    finally:
        r.close()
