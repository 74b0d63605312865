"""`kvq model pull URL` (resume after a cut, sha256), `kvq model inspect URL` (the header over
Range requests) and the sources a registration takes, against a local HTTP server with byte
ranges (`tests/rangeserver.py`)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rangeserver import range_server
from waiting import wait_for

from kvq.bus.redis_board import open_board
from kvq.cli import main
from kvq.config import Settings, child_env
from kvq.errors import ConfigError
from kvq.gguf.registry import plan_model
from kvq.gguf.remote import check_source, header_length


def test_pull_resumes_a_cut_download_and_checks_its_sha256(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    out = tmp_path / "pulled.gguf"
    part = tmp_path / "pulled.gguf.part"
    with range_server(tiny_path) as served:
        served.cut_at = 300_000  # the first answer stops there, the connection closed
        argv = ["model", "pull", served.url, "--out", str(out), "--sha256", sha]
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "cut at 300000" in err and "again to resume" in err, err
        assert part.stat().st_size == 300_000 and not out.exists()
        assert main([*argv, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
    assert served.ranges == [None, "bytes=300000-"], "the second run asked for the rest only"
    assert got == {"path": str(out), "bytes": len(data), "sha256": sha, "resumed_from": 300_000}
    assert out.read_bytes() == data and not part.exists()


def test_pull_starts_over_from_a_server_without_ranges_and_skips_a_whole_part(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    out = tmp_path / "m.gguf"
    with range_server(tiny_path) as served:
        served.honours_range, served.cut_at = False, 100_000
        argv = ["model", "pull", served.url, "--out", str(out), "--sha256", sha, "--json"]
        assert main(argv) == 1
        assert main(argv) == 0, "a 200 to the Range request: the whole file again"
        assert json.loads(capsys.readouterr().out)["resumed_from"] == 0
        assert out.read_bytes() == data
        # a part file already whole: the server's 416 says so, nothing is downloaded again
        out.rename(tmp_path / "m.gguf.part")
        served.honours_range = True
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["sha256"] == sha
    assert served.ranges[-1] == f"bytes={len(data)}-" and out.read_bytes() == data


def test_pull_deletes_a_download_whose_sha256_differs(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.gguf"
    with range_server(tiny_path) as served:
        assert main(["model", "pull", served.url, "--out", str(out), "--sha256", "0" * 64]) == 1
    err = capsys.readouterr().err
    assert "ModelError" in err and "!= --sha256 " + "0" * 64 in err, err
    assert not out.exists() and not (tmp_path / "x.gguf.part").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "pull", "ftp://example.com/m.gguf"],
        ["model", "inspect", "ftp://example.com/m.gguf"],
        ["monitor", "--model", "m=PATH", "--source", "ftp://example.com/m.gguf"],
    ],
    ids=["pull", "inspect", "monitor"],
)
def test_an_ftp_source_is_refused_naming_the_argument(
    argv: list[str], tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("PATH", str(tiny_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "scheme 'ftp' is not supported" in err and "http(s)://" in err, err
    assert ("--source" if argv[0] == "monitor" else f"kvq model {argv[1]}") in err


def test_registration_takes_paths_file_and_http_sources_only(tiny_path: Path) -> None:
    for ok in (str(tiny_path), f"file://{tiny_path}", "http://h/m.gguf", "https://h/m.gguf"):
        assert check_source(ok) == ok
    with pytest.raises(ConfigError, match=r"--source 'ftp://h/m.gguf': scheme 'ftp'"):
        plan_model("m", tiny_path, 1, 4, source="ftp://h/m.gguf")


def test_inspect_a_url_reads_its_header_only(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "inspect", str(tiny_path), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    with range_server(tiny_path) as served:
        assert main(["model", "inspect", served.url, "--json"]) == 0
        remote = json.loads(capsys.readouterr().out)
    assert remote.pop("path") == served.url and local.pop("path") == str(tiny_path)
    assert remote == local
    assert served.ranges == ["bytes=0-1048575"], "one Range request: the first MiB"
    data = tiny_path.read_bytes()
    assert header_length(data[:1000]) is None, "a header cut short asks for more"
    end = header_length(data)
    assert end is not None and 0 < end < len(data)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_monitor_given_a_url_pulls_it_then_registers_it(
    tiny_path: Path, tmp_path: Path, settings: Settings
) -> None:
    """`kvq monitor --model m=URL#sha256=HEX` (a real process, in its own directory): a cut
    download exits before anything is registered and keeps its part file; the next start asks
    for the rest only, checks the sha256 and registers the local file with the URL as the
    source workers fetch from. A wrong sha256 registers nothing."""
    data = tiny_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    env = child_env(settings)
    board = open_board(settings.bus, settings.lifetimes)

    def monitor(spec: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "kvq", "monitor", "--model", spec]
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE)

    with range_server(tiny_path) as served:
        served.cut_at = 300_000
        cut = monitor(f"m={served.url}#sha256={sha}")
        _, err = cut.communicate(timeout=60)
        assert cut.returncode == 1 and b"cut at 300000" in err, err.decode()[-2000:]
        assert board.models() == [] and (tmp_path / "tiny.gguf.part").stat().st_size == 300_000
        wrong = monitor(f"m={served.url}#sha256={'0' * 64}")
        _, err = wrong.communicate(timeout=60)
        assert wrong.returncode == 1 and b"!= --sha256 " + b"0" * 64 in err, err.decode()[-2000:]
        assert board.models() == [] and not (tmp_path / "tiny.gguf.part").exists()
        served.cut_at = 300_000
        again = monitor(f"m={served.url}")
        again.communicate(timeout=60)
        assert again.returncode == 1, "cut again"
        ok = monitor(f"m={served.url}#sha256={sha}")
        try:
            wait_for(lambda: board.models() == ["m"], 60, "the registration")
            assert served.ranges[-1] == "bytes=300000-", "the rest only"
            assert board.model_info("m").source == served.url.split("#")[0]
            assert (tmp_path / "tiny.gguf").read_bytes() == data
        finally:
            ok.terminate()
            ok.communicate(timeout=30)
    board.r.close()
