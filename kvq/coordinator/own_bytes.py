"""The coordinator checks its own bytes before it blames anyone.

A coordinator recomputes sampled remote results from its own copy of the model file; a
corrupted byte range there (a bad disk, a partial copy) would make every honest holder of that
slice look like a liar. So the expert ranges of the coordinator's file are checked against the
registration's checksums (`SliceSpec.sha256`): all of them by a background pass at start, and a
slice's at once, before a mismatch on it is charged to a worker. A corrupted range is refused:
the coordinator stops with `ModelCorrupt` naming it (no worker is blamed, and its requests go to
another coordinator of the model, which takes them over), so the operator replaces the file.

Only a full model file is checked here: a backbone file holds no routed expert (nothing is
recomputed from it), and its own bytes were checked against the source at start.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from kvq.catalog import ModelInfo
from kvq.errors import ModelCorrupt

log = logging.getLogger("kvq.coordinator")
_READ = 8 << 20  # bytes hashed per read


class OwnBytes:
    """The verdict on each slice's ranges in the coordinator's file, found when first asked."""

    def __init__(self, path: str | Path, info: ModelInfo) -> None:
        self.path, self.info = Path(path), info
        self._verdicts: dict[str, str] = {}  # sid -> "" (intact) or why not
        self._lock = threading.Lock()
        self.corrupt = ""  # the first corrupted range found, for the service loop to raise

    def check(self, sid: str) -> str:
        """Why slice `sid`'s ranges in this file differ from the registration ("": they do
        not, or the slice is unknown)."""
        spec = self.info.slices.get(sid)
        if spec is None:
            return ""
        with self._lock:
            if sid in self._verdicts:
                return self._verdicts[sid]
        why = ""
        with open(self.path, "rb") as f:
            for r, want in zip(spec.ranges, spec.sha256, strict=True):
                got = _sha256(f, r.offset, r.nbytes)
                if got != want:
                    why = (
                        f"this coordinator's model file {str(self.path)!r} is corrupt: {r.name} "
                        f"({r.nbytes} bytes at offset {r.offset}, slice {sid}) has sha256 "
                        f"{got[:16]}..., registered {want[:16]}...; no worker is blamed for "
                        "it. Replace the file with the registered one and restart"
                    )
                    break
        with self._lock:
            self._verdicts[sid] = why
            if why and not self.corrupt:
                self.corrupt = why
                log.error("%s", why)
        return why

    def refuse(self, sid: str) -> None:
        """Raise ModelCorrupt if slice `sid`'s bytes here are corrupted."""
        why = self.check(sid)
        if why:
            raise ModelCorrupt(why)

    def sweep(self, stop: threading.Event) -> int:
        """Check every slice until one is corrupted or `stop` is set; the slices checked."""
        n = 0
        for sid in sorted(self.info.slices):
            if stop.is_set() or self.corrupt:
                break
            self.check(sid)
            n += 1
        if not self.corrupt and not stop.is_set():
            log.info(
                "own bytes: the %d slices of %s in %s match the registration",
                n,
                self.info.model,
                self.path,
            )
        return n

    def start_sweep(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self.sweep, args=(stop,), name="own-bytes", daemon=True)
        t.start()
        return t


def _sha256(f, offset: int, nbytes: int) -> str:  # type: ignore[no-untyped-def]
    h = hashlib.sha256()
    f.seek(offset)
    left = nbytes
    while left > 0:
        chunk = f.read(min(_READ, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()
