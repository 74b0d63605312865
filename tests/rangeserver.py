"""A local HTTP server for files, with byte ranges (206) and a way to cut a download short:
what `kvq model pull` and `kvq model inspect URL` are tested against."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Served:
    """What the server serves and what it saw: the Range header of every GET (None: none)."""

    data: bytes
    url: str = ""
    ranges: list[str | None] = field(default_factory=list)
    cut_at: int | None = None  # the next answer stops after this many bytes of its body
    honours_range: bool = True  # False: every GET answered 200 with the whole file


def _handler(served: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            served.ranges.append(rng)
            data, n = served.data, len(served.data)
            got = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "") if served.honours_range else None
            if got:
                start = int(got[1])
                end = min(int(got[2]) if got[2] else n - 1, n - 1)
                if start >= n:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{n}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{n}")
                body = data[start : end + 1]
            else:
                self.send_response(200)
                body = data
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut, served.cut_at = served.cut_at, None
            self.wfile.write(body[:cut] if cut is not None else body)
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True

    return Handler


@contextmanager
def range_server(path: Path) -> Iterator[Served]:
    """Serve `path`'s bytes at `served.url` on 127.0.0.1 until the block ends."""
    served = Served(path.read_bytes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    host, port = server.server_address[:2]
    served.url = f"http://{host!s}:{port}/{path.name}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
