"""The dashboard's session cookie: good for reads of the API, never for a write, never
without the right MAC, never past its expiry or its logout, never a crash on odd bytes."""

from __future__ import annotations

import time

import pytest

from fleetserve.api.auth import SESSION_COOKIE, SESSION_SECONDS, ApiGuard, Sessions, cookie

TOKEN = "t" * 43
HOSTS = frozenset({"127.0.0.1"})


async def _app(_scope: object, _receive: object, _send: object) -> None:  # never reached
    raise AssertionError


SESSIONS = Sessions(TOKEN)


def check(method: str, path: str, session: str | None, **extra: str) -> int | None:
    guard = ApiGuard(_app, TOKEN, HOSTS, {}.get, max_body=1000, sessions=SESSIONS)
    headers = [(b"host", extra.pop("host", "127.0.0.1:46580").encode())]
    if session is not None:
        headers.append((b"cookie", f"theme=dark; {SESSION_COOKIE}={session}".encode()))
    headers += [(k.replace("_", "-").encode(), v.encode()) for k, v in extra.items()]
    problem = guard.check(method, path, headers)
    return None if problem is None else problem[0]


def test_a_session_reads_the_api() -> None:
    good = SESSIONS.issue(time.time())
    assert check("GET", "/api/v1/services", good) is None
    assert check("GET", "/api/v1/services/x/history", good) is None
    assert check("HEAD", "/api/v1/services", good) is None


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_a_session_never_writes(method: str) -> None:
    good = SESSIONS.issue(time.time())
    assert check(method, "/api/v1/services/x", good, content_type="application/json") == 401


def test_forged_expired_and_foreign_sessions_are_refused() -> None:
    now = time.time()
    good = SESSIONS.issue(now)
    expires, sid, mac = good.split(".")
    assert check("GET", "/api/v1/services", f"{int(expires) + 999}.{sid}.{mac}") == 401
    assert check("GET", "/api/v1/services", f"{expires}.{'A' * 16}.{mac}") == 401  # other id
    assert check("GET", "/api/v1/services", f"{expires}.{sid}.{'0' * 64}") == 401
    assert check("GET", "/api/v1/services", Sessions("another-token").issue(now)) == 401
    assert check("GET", "/api/v1/services", TOKEN) == 401  # the raw token is not a session
    assert check("GET", "/api/v1/services", "") == 401
    assert check("GET", "/api/v1/services", None) == 401
    old = SESSIONS.issue(now - SESSION_SECONDS - 10)
    assert not SESSIONS.valid(old, now)
    assert check("GET", "/api/v1/services", old) == 401
    assert not SESSIONS.valid("9" * 12 + f".{sid}.{mac}", now)  # an expiry far ahead


@pytest.mark.parametrize(
    "odd", ["\u00b2.abc", "\u00b2" * 12 + ".x.y", "1.\u0661" * 3, "..", "1..", "a" * 5000]
)
def test_odd_cookies_are_refused_not_crashed_on(odd: str) -> None:
    guard = ApiGuard(_app, TOKEN, HOSTS, {}.get, sessions=SESSIONS)
    headers = [(b"host", b"127.0.0.1"), (b"cookie", f"{SESSION_COOKIE}={odd}".encode())]
    problem = guard.check("GET", "/api/v1/services", headers)
    assert problem is not None and problem[0] == 401


def test_logout_ends_that_session_only() -> None:
    now = time.time()
    mine, other = SESSIONS.issue(now), SESSIONS.issue(now)
    SESSIONS.revoke(mine, now)
    assert not SESSIONS.valid(mine, now)
    assert SESSIONS.valid(other, now)
    SESSIONS.revoke("not a session", now)  # ignored


def test_revocations_are_bounded() -> None:
    sessions = Sessions(TOKEN, max_revoked=5)
    now = time.time()
    for _ in range(20):
        sessions.revoke(sessions.issue(now), now)
    assert len(sessions._revoked) <= 5


def test_the_session_is_not_the_token() -> None:
    value = SESSIONS.issue(time.time())
    assert TOKEN not in value
    assert SESSIONS.valid(value, time.time())


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
    evil = {"content_type": "application/json", "origin": "http://evil.example"}
    assert check("POST", "/ui/login", None, **evil) == 403
    assert check("GET", "/", None, host="evil.example") == 421  # DNS rebinding


def test_cookie_parsing() -> None:
    headers = [(b"cookie", b"a=1; fleetserve_session=abc; b=2")]
    assert cookie(headers) == "abc"
    assert cookie([(b"cookie", b"a=1")]) is None
    twice = [(b"cookie", b"fleetserve_session=x"), (b"cookie", b"fleetserve_session=y")]
    assert cookie(twice) == "y"
