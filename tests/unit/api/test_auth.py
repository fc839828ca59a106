"""The REST API's guard as a pure check: Host, Origin, token or wake secret, JSON-only,
body size. One row per case an attacker tries."""

from __future__ import annotations

import pytest

from fleetserve.api.auth import ApiGuard

TOKEN = "t" * 43
HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})


async def _app(_scope: object, _receive: object, _send: object) -> None:  # never reached
    raise AssertionError


def guard() -> ApiGuard:
    secrets = {"svc": "s" * 48}
    return ApiGuard(_app, TOKEN, HOSTS, secrets.get, max_body=1000)


def headers(**kw: str) -> list[tuple[bytes, bytes]]:
    base = {"host": "127.0.0.1:46580", "authorization": f"Bearer {TOKEN}"}
    base.update({k.replace("_", "-"): v for k, v in kw.items()})
    return [(k.encode(), v.encode()) for k, v in base.items() if v != "-"]


JSON = {"content_type": "application/json"}
WAKE = {"authorization": f"Bearer {'s' * 48}", **JSON}  # the service's LB wake credential
FORM = {"content_type": "application/x-www-form-urlencoded"}


@pytest.mark.parametrize(
    ("method", "path", "hdrs", "status"),
    [
        ("GET", "/api/v1/services", {}, None),
        ("GET", "/api/v1/health", {"authorization": "-"}, None),
        ("GET", "/api/v1/services", {"authorization": "-"}, 401),
        ("GET", "/api/v1/services", {"authorization": "Bearer nope"}, 401),
        ("GET", "/api/v1/services", {"authorization": f"Basic {TOKEN}"}, 401),
        ("GET", "/openapi.json", {"authorization": "-"}, 401),
        # the LB's wake-up call: its service's secret, on that route only, POST only
        (
            "POST",
            "/api/v1/services/svc/wake",
            {"authorization": f"Bearer {'s' * 48}", **JSON},
            None,
        ),
        (
            "POST",
            "/api/v1/services/other/wake",
            {"authorization": f"Bearer {'s' * 48}", **JSON},
            401,
        ),
        ("GET", "/api/v1/services", {"authorization": f"Bearer {'s' * 48}"}, 401),
        # DNS rebinding: only our own names
        ("GET", "/api/v1/services", {"host": "evil.example"}, 421),
        ("GET", "/api/v1/services", {"host": "127.0.0.1.evil.com"}, 421),
        ("GET", "/api/v1/services", {"host": "[::1]evil"}, 421),
        ("GET", "/api/v1/services", {"host": "localhost:evil"}, 421),
        ("GET", "/api/v1/services", {"host": "-"}, 421),
        ("GET", "/api/v1/services", {"host": "[::1]:46580"}, None),
        # browsers' cross-site requests
        ("GET", "/api/v1/services", {"origin": "http://evil.example"}, 403),
        ("GET", "/api/v1/services", {"origin": "null"}, 403),
        ("GET", "/api/v1/services", {"origin": "http://127.0.0.1:80@evil.com"}, 403),
        ("GET", "/api/v1/services", {"origin": "http://localhost:46580"}, None),
        # writes: JSON only, bounded
        ("POST", "/api/v1/services", {}, 415),
        ("POST", "/api/v1/services", {"content_type": "text/plain"}, 415),
        (
            "DELETE",
            "/api/v1/services/x",
            {"content_type": "application/x-www-form-urlencoded"},
            415,
        ),
        ("POST", "/api/v1/services", {**JSON, "content_length": "1001"}, 413),
        ("POST", "/api/v1/services", {**JSON, "content_length": "-1"}, 413),
        ("POST", "/api/v1/services", {**JSON, "content_length": "1000"}, None),
        ("POST", "/api/v1/services", {"content_type": "Application/JSON; charset=utf-8"}, None),
    ],
)
def test_the_guard(method: str, path: str, hdrs: dict[str, str], status: int | None) -> None:
    problem = guard().check(method, path, headers(**hdrs))
    assert (problem[0] if problem else None) == status, problem


def test_two_host_or_origin_or_authorization_headers_are_refused() -> None:
    for name in (b"host", b"origin", b"authorization"):
        hdrs = [*headers(origin="http://localhost"), (name, b"evil.example")]
        problem = guard().check("GET", "/api/v1/services", hdrs)
        assert problem is not None and problem[0] == 400, (name, problem)


async def test_a_trickled_body_gets_a_408_not_a_connection_held_forever() -> None:
    """A client that sends headers and then a body byte by byte, or never, is answered once
    the body's time is up (the slow-body form of slowloris)."""
    import asyncio

    reached: list[bool] = []

    async def app(_scope: object, _receive: object, _send: object) -> None:
        reached.append(True)

    guard = ApiGuard(app, TOKEN, HOSTS, {}.get, max_body=1000, body_seconds=0.2)
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}  # never ends

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/services",
        "headers": headers(content_type="application/json", content_length="1000"),
    }
    await asyncio.wait_for(guard(scope, receive, send), timeout=5)
    assert sent[0]["status"] == 408 and not reached
    assert b"did not arrive within 0.2 s" in sent[1]["body"]  # type: ignore[operator]
