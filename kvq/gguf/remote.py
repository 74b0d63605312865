"""A GGUF file behind a URL: where a model may come from, its download, its header over HTTP.

Sources are a path, a `file://` URL or an `http(s)://` URL whose server answers Range requests
(what workers fetch slices with, `kvq.worker.fetch`); anything else is refused where it is
given. `pull` downloads a whole file into `OUT.part`, resumes it with a Range request after a
cut, and renames it once complete and its sha256 matches. `header_copy` reads only a file's
header (metadata and tensor table) with Range requests into a sparse local copy, so that
everything that reads a header (`describe_model`) works on a URL.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import struct
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tqdm import tqdm

from kvq.errors import ConfigError, ModelError

log = logging.getLogger("kvq.model")
LOG_EVERY_S = 5.0  # a progress line this often when stderr is no terminal
SOURCE_SCHEMES = ("file", "http", "https")  # and a plain path
_CHUNK = 1 << 20
_HEADER_FIRST = 1 << 20  # bytes read first for a header; doubled until it is whole
_HEADER_MAX = 1 << 30


def check_source(source: str, what: str = "--source") -> str:
    """`source` if workers can fetch from it (a path, `file://`, `http(s)://`); else a
    ConfigError naming `what` (the flag or setting it came from)."""
    scheme = urlparse(source).scheme
    if scheme and scheme not in SOURCE_SCHEMES and not _windows_drive(scheme):
        raise ConfigError(
            f"{what} {source!r}: scheme {scheme!r} is not supported; give a path, a file:// "
            "URL or an http(s):// URL whose server answers Range requests (HTTP 206)"
        )
    return source


def _windows_drive(scheme: str) -> bool:
    return len(scheme) == 1  # `C:\models\x.gguf` parses as scheme `c`


def is_http(source: str) -> bool:
    return urlparse(source).scheme in ("http", "https")


def pull_target(url: str) -> tuple[str, str | None, str]:
    """`URL[#sha256=HEX]` split: the URL, its sha256 if given, and the file `pull` writes by
    default (the URL's file name, in the current directory)."""
    base, _, frag = url.partition("#")
    sha = frag.removeprefix("sha256=") if frag.startswith("sha256=") else None
    if frag and sha is None:
        raise ConfigError(f"{url!r}: the only fragment a URL takes is #sha256=HEX")
    return base, sha, Path(urlparse(base).path).name or "model.gguf"


@dataclass(frozen=True, slots=True)
class Pulled:
    """A finished download: where, how many bytes, its sha256, bytes kept from a cut one."""

    path: str
    nbytes: int
    sha256: str
    resumed_from: int


def pull(url: str, out: str | Path, sha256: str | None = None, timeout_s: float = 30.0) -> Pulled:
    """Download `url` to `out` through `out.part` (kept after a cut: the next call resumes it
    with a Range request); the file is renamed to `out` only once whole and, with `sha256`,
    matching it (a mismatch deletes the part file). The bytes are hashed as they arrive (a
    resumed part file's once, before)."""
    if not is_http(url):
        raise ConfigError(f"kvq model pull {url!r}: give an http(s):// URL")
    out = Path(out)
    part = out.with_name(out.name + ".part")
    start = os.path.getsize(part) if os.path.isfile(part) else 0
    h = _file_hash(part) if start else hashlib.sha256()
    start, total, h = _download(url, part, start, timeout_s, h)
    got = h.hexdigest()
    if sha256 is not None and got != sha256.lower():
        part.unlink()
        raise ModelError(
            f"{url}: sha256 {got} != --sha256 {sha256.lower()}; deleted {str(part)!r} (a "
            "different file or a corrupt download): check the URL and the checksum"
        )
    with open(part, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{url} is no GGUF file (no GGUF magic); kept {str(part)!r}")
    os.replace(part, out)
    return Pulled(str(out), total, got, start)


Hash = Any  # hashlib's object (its type is private)


def _download(url: str, part: Path, start: int, timeout_s: float, h: Hash) -> tuple[int, int, Hash]:
    """Append `url`'s bytes from `start` to `part` (from 0 if the server ignores the Range),
    hashing them into `h`: where it resumed, the file's total size and the hash. A cut raises
    ModelError, keeping what arrived."""
    headers = {"Range": f"bytes={start}-"} if start else {}
    try:
        resp = urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout_s
        )
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and start and _total(exc.headers.get("Content-Range")) == start:
            return start, start, h  # the part file is already whole
        raise ModelError(f"cannot download {url}: HTTP {exc.code} {exc.reason}") from None
    except OSError as exc:
        raise ModelError(f"cannot download {url}: {exc}") from None
    with resp:
        if resp.status == 206:
            total = _total(resp.headers.get("Content-Range"))
        else:  # the whole file again
            start, total, h = 0, int(resp.headers.get("Content-Length") or 0), hashlib.sha256()
        with open(part, "ab" if start else "wb") as f:
            got = _stream(resp, f, _Progress(url, start, total), h, part)
    if total and got != total:
        raise ModelError(
            f"download of {url} cut at {got} of {total} bytes; run the same command again "
            f"to resume from {str(part)!r}"
        )
    return start, got, h


def _stream(resp: Any, f: Any, bar: _Progress, h: Hash, part: Path) -> int:
    """Copy the body to `f` and `h`; the bytes the part file holds after it."""
    try:
        while chunk := resp.read(_CHUNK):
            f.write(chunk)
            h.update(chunk)
            bar.update(len(chunk))
    except (OSError, http.client.HTTPException) as exc:
        raise ModelError(
            f"download of {bar.url} cut at {bar.done} bytes ({exc}); run the same command "
            f"again to resume from {str(part)!r}"
        ) from None
    finally:
        bar.close()
    return bar.done


class _Progress:
    """A tqdm bar on a terminal; elsewhere a log line every `LOG_EVERY_S`."""

    def __init__(self, url: str, start: int, total: int) -> None:
        self.url, self.done, self.total = url, start, total
        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total or None,
            initial=start,
            unit="B",
            unit_scale=True,
            desc=Path(urlparse(url).path).name,
            disable=not tty,
        )
        self.log, self.t0, self.logged, self.start = not tty, time.monotonic(), 0.0, start

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.monotonic()
        if self.log and now - (self.logged or self.t0) >= LOG_EVERY_S:
            self.logged = now
            rate = (self.done - self.start) / max(now - self.t0, 1e-9)
            log.info(
                "pulling %s: %.1f of %.1f MB (%.2f MB/s)",
                self.url,
                self.done / 1e6,
                self.total / 1e6,
                rate / 1e6,
            )

    def close(self) -> None:
        self.bar.close()


def _total(content_range: str | None) -> int:
    """The size after the `/` of a Content-Range (`bytes 0-9/123`, `bytes */123`); 0 if none."""
    tail = (content_range or "").rpartition("/")[2]
    return int(tail) if tail.isdigit() else 0


def _file_hash(path: str | Path) -> Hash:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h


@contextmanager
def header_copy(url: str, timeout_s: float = 30.0) -> Iterator[str]:
    """A sparse local file as long as `url`'s, holding only its header (read with Range
    requests: 1 MiB, doubled until the tensor table is whole); deleted on exit."""
    n = _HEADER_FIRST
    while True:
        head, total = _range(url, 0, n, timeout_s)
        end = header_length(head)
        if end is not None or len(head) >= total or n >= _HEADER_MAX:
            break
        n *= 2
    if end is None:
        raise ModelError(f"{url}: no whole GGUF header in its first {len(head)} bytes")
    fd, path = tempfile.mkstemp(suffix=".gguf", prefix="kvq-header-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head[:end])
            f.truncate(total)  # the tensor data: a hole, never read
        yield path
    finally:
        os.unlink(path)


def _range(url: str, start: int, n: int, timeout_s: float) -> tuple[bytes, int]:
    """Bytes `start`..`start+n-1` of `url` and the file's total size."""
    req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{start + n - 1}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            if resp.status != 206:
                raise ModelError(
                    f"{url} answered {resp.status} to a Range request; the server must "
                    "support byte ranges (HTTP 206)"
                )
            return resp.read(), _total(resp.headers.get("Content-Range"))
    except urllib.error.HTTPError as exc:
        raise ModelError(f"cannot read {url}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ModelError(f"cannot read {url}: {exc}") from None


class _Cursor:
    """Reads a header from bytes; IndexError where they end (the caller reads more)."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise IndexError
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return int(v)

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise IndexError
        self.pos += n

    def string(self) -> bytes:
        n = self.take("<Q")
        self.skip(n)
        return self.buf[self.pos - n : self.pos]


# GGUF value types -> their fixed sizes (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _value(c: _Cursor, vtype: int) -> int | None:
    """Skip one value of `vtype`; an unsigned int's value (for `general.alignment`)."""
    if vtype == 8:
        c.string()
    elif vtype == 9:
        inner, count = c.take("<I"), c.take("<Q")
        if inner in _SIZES:
            c.skip(_SIZES[inner] * count)
        else:
            for _ in range(count):
                _value(c, inner)
    elif vtype == 4:
        return c.take("<I")
    elif vtype in _SIZES:
        c.skip(_SIZES[vtype])
    else:
        raise ModelError(f"not a GGUF header: value type {vtype}")
    return None


def header_length(buf: bytes) -> int | None:
    """Where the tensor data of the GGUF file starting with `buf` begins (its header's
    length, aligned), or None if `buf` ends inside the header."""
    if buf[:4] != b"GGUF" and len(buf) >= 4:
        raise ModelError("not a GGUF file (no GGUF magic)")
    c = _Cursor(buf)
    try:
        c.skip(8)  # magic, version
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        align = 32
        for _ in range(n_kv):
            key, vtype = c.string(), c.take("<I")
            v = _value(c, vtype)
            if key == b"general.alignment" and v:
                align = v
        for _ in range(n_tensors):
            c.string()
            c.skip(8 * c.take("<I") + 4 + 8)  # dims, type, offset
    except IndexError:
        return None
    return -(-c.pos // align) * align
