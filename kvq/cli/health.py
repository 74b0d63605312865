"""`kvq health`: exit 0 when a role is alive by the board's own rules, else 1 (for container
healthchecks, systemd and scripts). One line on stdout says what was checked."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from kvq.cli.common import EXIT_FAIL, EXIT_OK, node_id
from kvq.config import Settings

if TYPE_CHECKING:
    from kvq.bus.redis_board import RedisBoard

Subparsers = Any  # argparse's _SubParsersAction is private


def cmd_health(args: argparse.Namespace, settings: Settings) -> int:
    import redis

    from kvq.bus.redis_board import open_board

    board = open_board(settings.bus, settings.lifetimes)
    try:
        ok, what = check(board, args.role, args.id, settings)
    except redis.RedisError as exc:
        ok, what = False, f"redis: {exc}"
    finally:
        board.r.close()
    print(f"{'ok' if ok else 'unhealthy'}: {what}")
    return EXIT_OK if ok else EXIT_FAIL


def check(board: RedisBoard, role: str, ident: str | None, s: Settings) -> tuple[bool, str]:
    """(alive, what was checked); raises redis.RedisError when Redis does not answer."""
    board.r.ping()
    if role == "redis":
        return True, "redis answers"
    if role == "coordinator":
        coord = node_id(ident, "coord")
        return board.coordinator_alive(coord), f"coordinator {coord} publishes fresh slot state"
    if role == "worker":
        from kvq.identity import default_worker_id

        worker = ident or default_worker_id(s.state_dir)
        return board.worker_alive(worker), f"worker {worker} heartbeats"
    if ident is None:
        return False, "monitor: give the model id it registers (--id MODEL)"
    state = board.model_state(ident)
    within = max(5.0, 10 * s.monitor.poll_s)
    fresh = state is not None and state.fresh(time.time() * 1000, within)
    ok = fresh and ident in board.models()
    return ok, f"model {ident} is registered and a monitor wrote its state within {within:g}s"


def register(sub: Subparsers, bench: Subparsers) -> None:
    h = sub.add_parser("health", help="exit 0 if a role is alive (for healthchecks)")
    h.add_argument("role", choices=["redis", "monitor", "coordinator", "worker"],
                   help="what to check")  # fmt: skip
    h.add_argument(
        "--id", help="coordinator or worker id (default coord-HOSTNAME, or the kept worker id); for monitor, "
        "the id of a model it registers",
    )  # fmt: skip
    h.set_defaults(fn=cmd_health, kernels=False)
