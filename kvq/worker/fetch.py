"""Download exactly one slice's bytes (file path or http(s) Range requests) and verify them.

Progress shows on a terminal as a tqdm bar; without one (a service, a container log) as a log
line every `LOG_EVERY_S` with bytes, rate and ETA; and to a callback (the worker's heartbeat
record, `WorkerInfo.loaded_bytes`).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from urllib.parse import urlparse

from tqdm import tqdm

from kvq.errors import ModelError, SliceIntegrityError
from kvq.slices import SliceSpec

log = logging.getLogger("kvq.worker")
LOG_EVERY_S = 5.0
Progress = Callable[[int, int], None]  # (bytes so far, bytes in all)


class _Bar:
    """tqdm on a terminal, log lines elsewhere, and the progress callback."""

    def __init__(self, spec: SliceSpec, progress: Progress | None) -> None:
        self.sid, self.total, self.done = spec.sid, spec.nbytes, 0
        self.progress = progress
        self.t0 = self.logged = time.monotonic()
        show = sys.stderr.isatty()
        self.bar = tqdm(
            total=spec.nbytes, unit="B", unit_scale=True, desc=spec.sid, disable=not show
        )
        self.log = not show

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        if self.progress is not None:
            self.progress(self.done, self.total)
        now = time.monotonic()
        if self.log and now - self.logged >= LOG_EVERY_S and self.done < self.total:
            self.logged = now
            rate = self.done / max(now - self.t0, 1e-9)
            log.info(
                "downloading %s: %.1f of %.1f MB (%.2f MB/s, ETA %.0fs)",
                self.sid,
                self.done / 1e6,
                self.total / 1e6,
                rate / 1e6,
                (self.total - self.done) / rate,
            )

    def close(self) -> None:
        self.bar.close()


def fetch_slice(
    source: str, spec: SliceSpec, timeout_s: float, progress: Progress | None = None
) -> list[bytes]:
    """The bytes of every range of `spec`, checked against its published sizes and sha256."""
    scheme = urlparse(source).scheme
    bar = _Bar(spec, progress)
    try:
        if scheme in ("http", "https"):
            blobs = [_http_range(source, r.offset, r.nbytes, timeout_s, bar) for r in spec.ranges]
        elif scheme in ("", "file"):
            path = urlparse(source).path if scheme == "file" else source
            blobs = _file_ranges(path, [(r.offset, r.nbytes) for r in spec.ranges], bar)
        else:
            raise ModelError(f"unsupported model source {source!r}: use a path or http(s) URL")
    finally:
        bar.close()
    verify(spec, blobs)
    return blobs


def verify(spec: SliceSpec, blobs: Sequence[bytes]) -> None:
    """Refuse bytes whose size or checksum differs from what the monitor published."""
    for r, want, blob in zip(spec.ranges, spec.sha256, blobs, strict=True):
        if len(blob) != r.nbytes:
            raise SliceIntegrityError(
                f"slice {spec.sid} tensor {r.name}: got {len(blob)} bytes, expected {r.nbytes} "
                f"(truncated download or a different file)"
            )
        got = hashlib.sha256(blob).hexdigest()
        if got != want:
            raise SliceIntegrityError(
                f"slice {spec.sid} tensor {r.name}: sha256 {got[:16]}… != published "
                f"{want[:16]}… (tampered file or a different model version); not serving it"
            )


def _file_ranges(path: str, ranges: list[tuple[int, int]], bar: _Bar) -> list[bytes]:
    out = []
    try:
        with open(path, "rb") as f:
            for offset, n in ranges:
                f.seek(offset)
                out.append(f.read(n))
                bar.update(n)
    except OSError as exc:
        raise ModelError(f"cannot read model file {path!r}: {exc}") from None
    return out


def _http_range(url: str, offset: int, n: int, timeout_s: float, bar: _Bar) -> bytes:
    req = urllib.request.Request(url, headers={"Range": f"bytes={offset}-{offset + n - 1}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # http(s) only
            if resp.status != 206:
                raise ModelError(
                    f"{url} answered {resp.status} to a Range request; the server must support "
                    f"byte ranges (HTTP 206)"
                )
            chunks, got = [], 0
            while got < n:
                chunk = resp.read(min(1 << 20, n - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
                bar.update(len(chunk))
            return b"".join(chunks)
    except OSError as exc:
        raise ModelError(f"cannot download {url} bytes {offset}+{n}: {exc}") from None
