"""The dashboard's session cookie: good for reads of the API, never for a write, never
without the right MAC, never past its expiry."""

from __future__ import annotations

import time

import pytest

from fleetserve.api.auth import (
    SESSION_COOKIE,
    SESSION_SECONDS,
    ApiGuard,
    cookie,
    session_value,
    valid_session,
)

TOKEN = "t" * 43
HOSTS = frozenset({"127.0.0.1"})


async def _app(_scope: object, _receive: object, _send: object) -> None:  # never reached
    raise AssertionError


def check(method: str, path: str, session: str | None, **extra: str) -> int | None:
    guard = ApiGuard(_app, TOKEN, HOSTS, {}.get, max_body=1000)
    headers = [(b"host", extra.pop("host", "127.0.0.1:46580").encode())]
    if session is not None:
        headers.append((b"cookie", f"theme=dark; {SESSION_COOKIE}={session}".encode()))
    headers += [(k.replace("_", "-").encode(), v.encode()) for k, v in extra.items()]
    problem = guard.check(method, path, headers)
    return None if problem is None else problem[0]


def test_a_session_reads_the_api() -> None:
    good = session_value(TOKEN, time.time())
    assert check("GET", "/api/v1/services", good) is None
    assert check("GET", "/api/v1/services/x/history", good) is None
    assert check("HEAD", "/api/v1/services", good) is None


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_a_session_never_writes(method: str) -> None:
    good = session_value(TOKEN, time.time())
    assert check(method, "/api/v1/services/x", good, content_type="application/json") == 401


def test_forged_expired_and_foreign_sessions_are_refused() -> None:
    now = time.time()
    good = session_value(TOKEN, now)
    expires, _, mac = good.partition(".")
    assert check("GET", "/api/v1/services", f"{int(expires) + 999}.{mac}") == 401  # extended
    assert check("GET", "/api/v1/services", f"{expires}.{'0' * len(mac)}") == 401
    assert check("GET", "/api/v1/services", session_value("another-token", now)) == 401
    assert check("GET", "/api/v1/services", TOKEN) == 401  # the raw token is not a session
    assert check("GET", "/api/v1/services", "") == 401
    assert check("GET", "/api/v1/services", None) == 401
    old = session_value(TOKEN, now - SESSION_SECONDS - 10)
    assert not valid_session(old, TOKEN, now)
    assert check("GET", "/api/v1/services", old) == 401
    assert not valid_session("9" * 40 + "." + mac, TOKEN, now)  # absurd expiry


def test_the_session_is_not_the_token() -> None:
    value = session_value(TOKEN, time.time())
    assert TOKEN not in value
    assert valid_session(value, TOKEN, time.time())


def test_dashboard_pages_and_static_files_are_open_but_nothing_else() -> None:
    assert check("GET", "/", None) is None  # the page itself sends a visitor to /login
    assert check("GET", "/login", None) is None
    assert check("GET", "/ui/static/dashboard.js", None) is None
    assert check("POST", "/ui/static/dashboard.js", None, content_type="application/json") == 401
    assert check("GET", "/ui/other", None) == 401
    assert check("GET", "/metrics", None) == 401
    # the login call itself: JSON only, and from this controller's own pages
    assert check("POST", "/ui/login", None, content_type="text/plain") == 415
    assert check("POST", "/ui/login", None, content_type="application/json") is None
    assert (
        check(
            "POST", "/ui/login", None, content_type="application/json", origin="http://evil.example"
        )
        == 403
    )
    assert check("GET", "/", None, host="evil.example") == 421  # DNS rebinding


def test_cookie_parsing() -> None:
    headers = [(b"cookie", b"a=1; fleetserve_session=abc; b=2")]
    assert cookie(headers) == "abc"
    assert cookie([(b"cookie", b"a=1")]) is None
    assert (
        cookie([(b"cookie", b"fleetserve_session=x"), (b"cookie", b"fleetserve_session=y")]) == "y"
    )
