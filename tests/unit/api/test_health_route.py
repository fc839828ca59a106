"""/api/v1/health, the one route open without the token: it tells a client whether this is its
own controller (a hash of the home) and nothing more; the pid, the home's path and how local
processes are stopped only to a caller with the token."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller
from fleetserve.home.settings import home_hash
from tests.unit.api.conftest import TOKEN


def test_the_open_answer_names_no_path_and_no_pid(api: tuple[TestClient, Controller]) -> None:
    client, ctl = api
    r = client.get("/api/v1/health", headers={"Authorization": ""})
    assert r.status_code == 200
    body = r.json()
    assert body["home_hash"] == home_hash(ctl.settings.home, TOKEN)
    assert body["ok"] is True and body["role"] == "active"
    assert "pid" not in body and "home" not in body and "processes" not in body
    assert str(ctl.settings.home) not in r.text


def test_a_wrong_token_gets_the_open_answer(api: tuple[TestClient, Controller]) -> None:
    client, _ = api
    body = client.get("/api/v1/health", headers={"Authorization": "Bearer " + "x" * 43}).json()
    assert "pid" not in body and "home" not in body


def test_the_token_gets_the_pid_and_the_home(api: tuple[TestClient, Controller]) -> None:
    client, ctl = api
    body = client.get("/api/v1/health").json()  # (the fixture's client sends the token)
    assert body["home"] == str(ctl.settings.home)
    assert isinstance(body["pid"], int) and body["pid"] > 0
    assert body["home_hash"] == home_hash(ctl.settings.home, TOKEN)


def test_the_hash_needs_the_token() -> None:
    """Keyed with the token: homes hash apart, and a guess of the path without the token
    (`/home/<user>/.fleetserve`) does not give the same hash."""
    a, b = "/home/a/.fleetserve", "/home/b/.fleetserve"
    assert home_hash(a, TOKEN) != home_hash(b, TOKEN)
    assert home_hash(a, TOKEN) == home_hash(a, TOKEN)
    assert home_hash(a, TOKEN) != home_hash(a, "") != home_hash(a, "x" * 43)
    assert "fleetserve" not in home_hash(a, TOKEN)
