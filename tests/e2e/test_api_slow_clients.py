"""The controller's API against slow clients (fleetserve.api.connections): heads trickled
past the deadline get a 408, stalled TLS handshakes are closed, and hundreds of connections
held open without the token (trickled heads, idle keep-alives, slow bodies, stalled or
half-sent TLS handshakes; by another local user or by the owner's own uid) leave the owner's
CLI and a remote token holder served. A real controller, real sockets, real TLS; the slow
clients are tests/e2e/slow_clients.py in a process of their own (as `nobody` when root)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import Fleet, fleet_in

HEAD_SECONDS = 1.0
PER_CLIENT = 8
SLOW = Path(__file__).with_name("slow_clients.py")
OTHER_USER = "nobody" if os.geteuid() == 0 else None  # else: the owner's own uid


def _settings(fleet: Fleet) -> None:
    fleet.env["FLEETSERVE_API_HEADER_TIMEOUT"] = str(HEAD_SECONDS)
    fleet.env["FLEETSERVE_API_MAX_CLIENT_CONNECTIONS"] = str(PER_CLIENT)
    fleet.env["FLEETSERVE_API_MAX_CONNECTIONS"] = "64"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    for fleet in fleet_in(tmp_path_factory.mktemp("plain")):
        _settings(fleet)
        fleet.cli("server", "start")
        yield fleet
        fleet.cli("server", "stop")  # (no service was started: nothing to take down)
        _no_traceback(fleet)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, dict[str, str]]]:
    """A controller on 0.0.0.0 with TLS, and the environment of a remote CLI (127.0.0.2)."""
    import trustme

    tmp = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.2", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    for fleet in fleet_in(tmp):
        _settings(fleet)
        fleet.cli(
            *("server", "start", "--host", "0.0.0.0", "--allowed-host", "127.0.0.2"),
            *("--tls-cert", str(tmp / "cert.pem"), "--tls-key", str(tmp / "key.pem")),
        )
        env = {
            **fleet.env,
            "FLEETSERVE_HOME": str(tmp / "laptop"),
            "FLEETSERVE_API_URL": f"https://127.0.0.2:{fleet.env['FLEETSERVE_API_PORT']}",
            "FLEETSERVE_API_CA": str(tmp / "ca.pem"),
            "FLEETSERVE_API_TOKEN": (fleet.home / "api-token").read_text().strip(),
        }
        yield fleet, env
        fleet.cli("server", "stop")
        _no_traceback(fleet)


def _no_traceback(fleet: Fleet) -> None:
    log = (fleet.home / "logs" / "controller.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def _port(fleet: Fleet) -> int:
    return int(fleet.env["FLEETSERVE_API_PORT"])


def _slow(
    port: int, mode: str, count: int, user: str | None, seconds: float = 30
) -> subprocess.Popen[str]:
    """Slow clients until `_finish` (or `seconds`): longer than the CLI waits for a busy
    controller (10 s), so a controller they take over fails the CLI. The system's python3
    (standard library only) can run as another user."""
    python = "/usr/bin/python3" if user else sys.executable
    return subprocess.Popen(
        [python, "-c", SLOW.read_text(), "127.0.0.1", str(port), mode, str(count), str(seconds)],
        user=user,
        cwd="/",
        stdout=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]]) -> list[dict[str, int]]:
    results = []
    for p in procs:
        p.terminate()
    for p in procs:
        out, _ = p.communicate(timeout=60)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _held_by_controller(fleet: Fleet) -> int:
    """Connections the controller process holds open to its API port."""
    pid = int(json.loads((fleet.home / "server.json").read_text())["pid"])
    port = _port(fleet)
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def _read_all(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sends until it closes (or `seconds` pass), and when it closed."""
    start = time.monotonic()
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data, time.monotonic() - start


def test_a_head_trickled_past_the_deadline_gets_a_408_and_a_silent_connection_is_closed(
    plain: Fleet,
) -> None:
    port = _port(plain)
    with socket.create_connection(("127.0.0.1", port)) as trickle:
        trickle.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        answer = b""
        trickle.settimeout(0.3)
        while time.monotonic() - start < HEAD_SECONDS + 5 and not answer:
            try:
                answer = trickle.recv(65536)
            except TimeoutError:
                trickle.sendall(b"X-Slow: 1\r\n")  # a line every 0.3 s: never the end
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1 s" in answer
    assert HEAD_SECONDS - 0.2 <= took <= HEAD_SECONDS + 2
    with socket.create_connection(("127.0.0.1", port)) as silent:
        data, took = _read_all(silent, HEAD_SECONDS + 5)
    assert data.startswith(b"HTTP/1.1 408") and took <= HEAD_SECONDS + 2
    # A keep-alive connection: the next request's head is timed from its first byte.
    with socket.create_connection(("127.0.0.1", port)) as kept:
        kept.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        kept.settimeout(5)
        first = b""
        while not first.endswith(b"}"):  # the whole answer (head and JSON body)
            first += kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(HEAD_SECONDS + 0.3)  # idle: uvicorn's keep-alive time, not the head's
        kept.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
        data, took = _read_all(kept, HEAD_SECONDS + 5)
    assert data.startswith(b"HTTP/1.1 408") and took <= HEAD_SECONDS + 2


def test_hundreds_of_slow_connections_leave_the_owners_cli_served(plain: Fleet) -> None:
    """900 connections without the token, held (reopened as soon as they are closed): 600 of
    three shapes by another user, and 300 trickled heads by the owner's own uid and address,
    which are not told apart from the CLI's before its token, but the CLI sends its request at
    once and pushes out the oldest slow one. The controller holds at most the per-client
    bound of each, answers /health and serves the owner's CLI."""
    port = _port(plain)
    procs = [
        _slow(port, "head", 300, OTHER_USER),
        _slow(port, "idle", 200, OTHER_USER),
        _slow(port, "body", 100, OTHER_USER),
        _slow(port, "head", 300, None),
    ]
    try:
        time.sleep(1.5)
        start = time.monotonic()
        with urllib.request.urlopen(f"{plain.api}/health", timeout=5) as r:
            assert r.status == 200
        status = plain.cli("status", timeout=30)
        assert "No services" in status.stdout
        assert time.monotonic() - start < 15
        held = _held_by_controller(plain)
    finally:
        results = _finish(procs)
    # At most the per-client bound of each client at once (+ the CLI's own).
    assert held <= (2 if OTHER_USER else 1) * PER_CLIENT + 4, held
    assert sum(r["most"] for r in results) >= 850  # the clients did hold their connections
    assert all(r["closed"] > 0 for r in results)  # and the controller closed theirs


def test_stalled_tls_handshakes_are_closed_and_leave_a_remote_cli_served(
    remote: tuple[Fleet, dict[str, str]],
) -> None:
    fleet, env = remote
    port = _port(fleet)
    with socket.create_connection(("127.0.0.1", port)) as silent:
        data, took = _read_all(silent, HEAD_SECONDS + 5)
    assert data == b"" and took <= HEAD_SECONDS + 2  # closed, unanswered, in time
    # A TLS client that stops after its handshake, in the middle of its head: a 408.
    context = ssl.create_default_context(cafile=env["FLEETSERVE_API_CA"])
    with (
        socket.create_connection(("127.0.0.2", port)) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.2") as tls,
    ):
        tls.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
        data, took = _read_all(tls, HEAD_SECONDS + 5)
    assert data.startswith(b"HTTP/1.1 408") and took <= HEAD_SECONDS + 2
    procs = [
        _slow(port, "silent", 250, OTHER_USER),
        _slow(port, "hello", 250, OTHER_USER),
        _slow(port, "head", 100, OTHER_USER),
    ]
    try:
        time.sleep(1.5)
        start = time.monotonic()
        status = subprocess.run(
            [sys.executable, "-m", "fleetserve", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert "No services" in status.stdout
        assert time.monotonic() - start < 15
        held = _held_by_controller(fleet)
    finally:
        results = _finish(procs)
    if OTHER_USER:
        assert held <= PER_CLIENT + 4, held
    assert sum(r["most"] for r in results) >= 550
    assert not (Path(env["FLEETSERVE_HOME"])).exists()  # the remote CLI started nothing
