"""The CLI and SDK tell a busy controller (it takes the connection, then answers 503 or
closes it) from a missing one (nothing listens): real sockets on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import fleetserve.client as client_mod
from fleetserve.client import Client
from fleetserve.core.errors import TransientError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Busy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "19")
        self.end_headers()
        self.wfile.write(b"Service Unavailable")

    def log_message(self, *_a: object) -> None:
        pass


@pytest.fixture
def busy_503() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def closes_at_once() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join()
    listener.close()


def _client(port: int, tmp_path: Path) -> Client:
    return Client(url=f"http://127.0.0.1:{port}", auto_start=False, token="t" * 43)


@pytest.fixture(autouse=True)
def _short_wait(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(client_mod, "BUSY_WAIT_SECONDS", 0.6)
    monkeypatch.setenv("FLEETSERVE_HOME", str(tmp_path / "home"))


def test_nothing_listening_is_a_missing_controller(tmp_path: Path) -> None:
    with pytest.raises(TransientError) as e, _client(_free_port(), tmp_path) as c:
        c.status()
    assert "no fleetserve controller answers" in e.value.message
    assert "connection refused" in e.value.message


def test_a_controller_answering_503_is_busy_not_missing(busy_503: int, tmp_path: Path) -> None:
    with pytest.raises(TransientError) as e, _client(busy_503, tmp_path) as c:
        c.status()
    assert "is busy: it answered 503" in e.value.message
    assert "no fleetserve controller" not in e.value.message
    assert "do not start another" in e.value.message


def test_a_controller_closing_new_connections_is_busy(closes_at_once: int, tmp_path: Path) -> None:
    with pytest.raises(TransientError) as e, _client(closes_at_once, tmp_path) as c:
        c.status()
    assert "is busy: it closed the connection before answering" in e.value.message


def test_the_cli_says_missing_in_one_line_with_exit_5(tmp_path: Path) -> None:
    """The CLI against a missing remote controller: one line, exit 5, no traceback (the busy
    one takes the CLI's whole 10 s wait: its message is checked above, on the SDK)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
    env.update(
        {
            "FLEETSERVE_HOME": str(tmp_path / "home"),
            "FLEETSERVE_API_URL": f"http://127.0.0.1:{_free_port()}",
            "FLEETSERVE_API_TOKEN": "t" * 43,
            "NO_COLOR": "1",
        }
    )
    missing = subprocess.run(
        [sys.executable, "-m", "fleetserve", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 5
    assert "no fleetserve controller answers" in missing.stderr
    assert "(connection refused; start one with" in missing.stderr
    assert "Traceback" not in missing.stderr + missing.stdout
