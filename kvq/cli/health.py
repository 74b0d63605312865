"""`kvq health`: exit 0 when a role is alive by the board's own rules, else 1 (for container
healthchecks, systemd and scripts). One line on stdout says what was checked."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from kvq.cli.common import EXIT_FAIL, EXIT_OK, node_id
from kvq.config import Settings

if TYPE_CHECKING:
    from kvq.bus.redis_board import RedisBoard

Subparsers = Any  # argparse's _SubParsersAction is private


def cmd_health(args: argparse.Namespace, settings: Settings) -> int:
    import redis

    if args.role == "api":
        ok, what = check_api(args.id or f"http://127.0.0.1:{settings.api.port}")
        print(f"{'ok' if ok else 'unhealthy'}: {what}")
        return EXIT_OK if ok else EXIT_FAIL

    # one try, no blocking reads: a port that accepts and never answers fails the check
    # within KVQ_SOCKET_TIMEOUT_S instead of holding it through the client's retries
    bus = dataclasses.replace(settings.bus, block_ms=0)
    if args.role == "redis":  # a ping needs no board (whose records import numpy and gguf)
        from kvq.bus import connect

        r = connect(bus, retries=0)
        try:
            r.ping()
            ok, what = True, "redis answers"
        except redis.RedisError as exc:
            ok, what = False, f"redis: {exc}"
        finally:
            r.close()
        print(f"{'ok' if ok else 'unhealthy'}: {what}")
        return EXIT_OK if ok else EXIT_FAIL

    from kvq.bus import connect
    from kvq.bus.redis_board import RedisBoard
    from kvq.keys import Keys

    board = RedisBoard(connect(bus, retries=0), Keys(bus.prefix), settings.lifetimes)
    try:
        ok, what = check(board, args.role, args.id, settings)
    except redis.RedisError as exc:
        ok, what = False, f"redis: {exc}"
    finally:
        board.r.close()
    print(f"{'ok' if ok else 'unhealthy'}: {what}")
    return EXIT_OK if ok else EXIT_FAIL


def check_api(url: str) -> tuple[bool, str]:
    """`kvq api` at `url` answers `GET /health` with 200 (it pings Redis itself)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status == 200, f"kvq api at {url} answers /health"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"kvq api at {url}: {exc}"


def check(board: RedisBoard, role: str, ident: str | None, s: Settings) -> tuple[bool, str]:
    """(alive, what was checked); raises redis.RedisError when Redis does not answer."""
    board.r.ping()
    if role == "redis":
        return True, "redis answers"
    if role == "coordinator":
        coord = node_id(ident, "coord")
        return board.coordinator_alive(coord), f"coordinator {coord} publishes fresh slot state"
    if role == "worker":
        from kvq.security.identity import default_worker_id

        worker = ident or default_worker_id(s.state_dir)
        alive = board.worker_alive(worker)
        info = board.worker_info(worker) if alive else None
        said = f" (kernels: {info.kernels})" if info is not None and info.kernels else ""
        return alive, f"worker {worker} heartbeats{said}"
    if ident is None:
        return False, "monitor: give the model id it registers (--id MODEL)"
    state = board.model_state(ident)
    within = max(5.0, 10 * s.monitor.poll_s)
    fresh = state is not None and state.fresh(board.now_ms(), within)
    ok = fresh and ident in board.models()
    return ok, f"model {ident} is registered and a monitor wrote its state within {within:g}s"


def register(sub: Subparsers, bench: Subparsers) -> None:
    h = sub.add_parser("health", help="exit 0 if a role is alive (for healthchecks)")
    h.add_argument(
        "role", choices=["redis", "monitor", "coordinator", "worker", "api"], help="what to check"
    )
    h.add_argument(
        "--id",
        help="coordinator or worker id (default coord-HOSTNAME, or the kept worker id); for monitor, "
        "the id of a model it registers; for api, its base URL (default http://127.0.0.1:KVQ_API_PORT)",
    )
    h.set_defaults(fn=cmd_health, kernels=False)
