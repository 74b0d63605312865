"""Slice download: exactly the slice's bytes over HTTP Range, verified against checksums."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.config import load_settings
from kvq.errors import ModelError, SliceIntegrityError
from kvq.gguf import read_meta
from kvq.gguf.registry import plan_slices
from kvq.tools.synth import make_tiny
from kvq.worker.fetch import fetch_slice


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files with single-range support and counts the body bytes it sends."""

    sent = 0

    def do_GET(self) -> None:  # http.server's naming
        path = Path(self.translate_path(self.path))
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if not rng:
            self.send_response(200)
            body = data
        else:
            start, end = (int(p) for p in rng.removeprefix("bytes=").split("-"))
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        type(self).sent += len(body)  # before the write: the client may check as soon as it has it
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    return path


@pytest.fixture
def http_url(model: Path) -> Iterator[str]:
    handler = functools.partial(_RangeHandler, directory=str(model.parent))
    _RangeHandler.sent = 0
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/{model.name}"
    srv.shutdown()
    srv.server_close()


def _slices(model: Path):  # type: ignore[no-untyped-def]
    s = load_settings(slice_experts=4)
    return plan_slices(read_meta(model), model, s.slice_layers, s.slice_experts)


def test_http_range_fetch_transfers_exactly_the_slice(model: Path, http_url: str) -> None:
    spec = _slices(model)[1]
    blobs = fetch_slice(http_url, spec, timeout_s=10)
    assert _RangeHandler.sent == spec.nbytes
    assert blobs == fetch_slice(str(model), spec, timeout_s=10)
    assert spec.nbytes < model.stat().st_size / 4


def test_tampered_file_is_refused(model: Path, http_url: str) -> None:
    spec = _slices(model)[0]
    data = bytearray(model.read_bytes())
    data[spec.ranges[0].offset + 10] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(SliceIntegrityError, match="sha256"):
        fetch_slice(str(model), spec, timeout_s=10)
    with pytest.raises(SliceIntegrityError, match="sha256"):
        fetch_slice(http_url, spec, timeout_s=10)


def test_truncated_file_is_refused(model: Path) -> None:
    spec = _slices(model)[-1]
    model.write_bytes(model.read_bytes()[: spec.ranges[-1].offset + 5])
    with pytest.raises(SliceIntegrityError, match="bytes"):
        fetch_slice(str(model), spec, timeout_s=10)


def test_bad_source_is_a_model_error(model: Path) -> None:
    spec = dataclasses.replace(_slices(model)[0])
    with pytest.raises(ModelError, match="unsupported model source"):
        fetch_slice("ftp://example/m.gguf", spec, timeout_s=1)
    with pytest.raises(ModelError, match="cannot read"):
        fetch_slice(str(model) + ".missing", spec, timeout_s=1)
