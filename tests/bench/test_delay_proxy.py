"""The delaying TCP proxy `kvq bench offload --rtt-ms` puts between workers and Redis: bytes
arrive intact and in order, one round trip later; Redis works through it."""

from __future__ import annotations

import socket
import threading
import time

import redis

from kvq.local.server import EmbeddedRedis
from kvq.tools.bench.delay_proxy import DelayProxy


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _round_trip_ms(port: int, payload: bytes) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port)) as c:
        t = time.perf_counter()
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += c.recv(65536)
        return (time.perf_counter() - t) * 1000, got


def test_adds_the_round_trip_and_keeps_the_bytes() -> None:
    srv, port = _echo_server()
    try:
        direct, _ = _round_trip_ms(port, b"x")
        payload = bytes(range(256)) * 1024  # 256 KB, several chunks each way
        with DelayProxy("127.0.0.1", port, rtt_ms=40) as proxy:
            slow, got = _round_trip_ms(proxy.port, payload)
            assert got == payload
            small, _ = _round_trip_ms(proxy.port, b"ping")
        assert 40 <= small < 40 + 30 + direct, f"{small:.1f} ms for a 40 ms proxy"
        assert slow >= 40
    finally:
        srv.close()


def test_redis_through_the_proxy() -> None:
    with EmbeddedRedis() as server, DelayProxy("127.0.0.1", server.port, rtt_ms=20) as proxy:
        r = redis.Redis(host="127.0.0.1", port=proxy.port)
        try:
            t = time.perf_counter()
            assert r.ping()
            r.set("k", b"v" * 100_000)
            assert r.get("k") == b"v" * 100_000
            assert (time.perf_counter() - t) * 1000 >= 3 * 20  # three round trips
        finally:
            r.close()
