"""A worker's default id: the host name plus a random suffix made once and kept on disk.

Unique (two machines with the same host name differ by the suffix) and stable (a restarted
worker comes back under the same id, so its ACL user `kvq-worker-<id>` and its pending jobs
stay its own). The file lives in `KVQ_STATE_DIR` (default `~/.config/kvq`); two workers on one
machine need two state dirs or explicit `--id`s.
"""

from __future__ import annotations

import re
import secrets
import socket
from pathlib import Path

from kvq.errors import ConfigError
from kvq.keys import check_id

ID_FILE = "worker-id"


def state_dir(configured: str) -> Path:
    return Path(configured).expanduser() if configured else Path.home() / ".config" / "kvq"


def default_worker_id(configured_state_dir: str, hostname: str | None = None) -> str:
    """The id kept in `<state dir>/worker-id`, made (`<host>-<6 hex>`) on first use."""
    path = state_dir(configured_state_dir) / ID_FILE
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    except OSError as exc:
        raise ConfigError(f"cannot read {path} (KVQ_STATE_DIR): {exc}") from None
    if kept:
        return check_id(f"the worker id in {path}", kept)
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", hostname or socket.gethostname())[:50] or "worker"
    made = f"{host}-{secrets.token_hex(3)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(made + "\n")
    except OSError as exc:
        raise ConfigError(
            f"cannot keep the worker id in {path}: {exc}; set KVQ_STATE_DIR or pass --id"
        ) from None
    return made
