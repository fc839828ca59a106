"""The SDK sends its token only to a controller of this user: who listens on the API port is
read from /proc/net/tcp before every request (never trusted from an earlier connection)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetserve.client import Client
from fleetserve.controller.settings import Settings
from fleetserve.core.errors import FleetserveError, InvalidSpec, TransientError, Unauthorized
from fleetserve.core.sockets import listener_uids
from fleetserve.home.settings import home_hash
from tests.nobody import NOBODY, nobody_listening


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_listener_uids_sees_this_users_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listener_uids(port) == set()  # bound, not listening
        s.listen()
        assert listener_uids(port) == {os.getuid()}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as `nobody`")
def test_listener_uids_sees_another_users_listener() -> None:
    port = _free_port()
    with nobody_listening(port):
        assert listener_uids(port) == {NOBODY}


def test_no_listener_means_no_token(tmp_path: Path) -> None:
    """Fail closed: a port nobody listens on (a fake controller that closed its listening
    socket but kept a connection) gets no request at all. It says so as a controller that
    does not answer (exit 5, which a waiting command rides out: a controller restarting),
    not as a stranger's port (exit 7)."""
    settings = Settings(home=tmp_path, api_port=_free_port())
    client = Client(settings=settings, auto_start=False, token="t" * 43)
    client._checked = True  # as if /health had answered
    with pytest.raises(TransientError, match="nothing listens on port") as e:
        client.status()
    assert e.value.exit_code == 5


def test_a_remote_url_must_be_https(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    with pytest.raises(InvalidSpec, match="not https"):
        Client(url="http://fleet.example:46580", settings=settings, token="t" * 43)
    Client(url="https://fleet.example:46580", settings=settings, token="t" * 43).close()


def _serving(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """This user's throwaway HTTP server of `folder`'s files, listening, and its port."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not listener_uids(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, port


def test_this_users_listener_gets_the_request(tmp_path: Path) -> None:
    """The positive case, with a throwaway HTTP server of this user."""
    server, port = _serving(tmp_path)
    try:
        client = Client(
            settings=Settings(home=tmp_path, api_port=port), auto_start=False, token="t" * 43
        )
        client._checked = True
        # http.server answers 404 for /api/v1/services: the request went out (no Unauthorized).
        with pytest.raises(Exception) as e:
            client.status()
        assert not isinstance(e.value, Unauthorized)
    finally:
        server.kill()
        server.wait()


def _serving_health(folder: Path, body: str) -> tuple[subprocess.Popen[bytes], int]:
    """This user's throwaway server whose /api/v1/health answers `body`."""
    (folder / "api" / "v1").mkdir(parents=True)
    (folder / "api" / "v1" / "health").write_text(body)
    return _serving(folder)


@pytest.mark.parametrize("other", [True, False])
def test_the_health_answer_tells_this_homes_controller_by_its_hash(
    tmp_path: Path, other: bool
) -> None:
    """The open /health names no path: the client compares the home's hash (keyed with the
    token it holds), and a controller of another home (same user, same port) is refused by
    name, not sent requests; so is one whose hash was made with another token."""
    home = tmp_path / "home"
    token = "k" * 43
    said = home_hash(tmp_path / "elsewhere" if other else home, token)
    server, port = _serving_health(tmp_path / "www", f'{{"ok": true, "home_hash": "{said}"}}')
    try:
        settings = Settings(home=home, api_port=port)
        client = Client(settings=settings, auto_start=False, token=token)
        if other:
            with pytest.raises(FleetserveError, match="another FLEETSERVE_HOME"):
                client.reachability()
        else:
            assert client.reachability() == ("ok", "")
            other_token = Client(settings=settings, auto_start=False, token="j" * 43)
            with pytest.raises(FleetserveError, match="another FLEETSERVE_HOME"):
                other_token.reachability()
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("token", ["t\udcffoken", "tökén-wrong", " ", "two words"])
def test_a_token_that_is_no_token_is_refused_as_such(tmp_path: Path, token: str) -> None:
    """A FLEETSERVE_API_TOKEN with spaces, control or non-ASCII characters (an API token has
    none) is refused with a clear error (exit 7), not a traceback from hashing or sending it."""
    client = Client(settings=Settings(home=tmp_path), auto_start=False, token=token)
    with pytest.raises(Unauthorized, match="not an API token"):
        client.token()


def test_a_home_without_its_token_file_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This home's token file gone while a controller answers: the client says the token is
    missing, not that another home holds the port (second review)."""
    monkeypatch.delenv("FLEETSERVE_API_TOKEN", raising=False)
    home = tmp_path / "home"
    said = home_hash(home, "k" * 43)
    server, port = _serving_health(tmp_path / "www", f'{{"ok": true, "home_hash": "{said}"}}')
    try:
        client = Client(settings=Settings(home=home, api_port=port), auto_start=False)
        with pytest.raises(Unauthorized, match="no API token"):
            client.reachability()
    finally:
        server.kill()
        server.wait()
