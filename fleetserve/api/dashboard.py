"""The dashboard: a page of the controller at `/` (docs/dashboard.md).

Its HTML, script and style ship in the package (fleetserve/api/static/; no CDN, no build
step): the script reads the same REST API as the CLI, with the session cookie that logging in
sets, polling with ETags. The login link that `fleetserve dashboard` prints carries a one-time
code (two minutes, one use) in its #fragment, which no browser sends to a server; the login
page posts it once and drops it from the address bar. The cookie is HttpOnly and
SameSite=Strict, and good for reads only.
"""

from __future__ import annotations

import hmac
import secrets
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fleetserve.api.auth import (
    SESSION_COOKIE,
    SESSION_SECONDS,
    STATIC_PREFIX,
    Sessions,
    cookie,
)

# Every file the dashboard serves, and its type: nothing else is reachable under the prefix.
STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "login.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# The pages run only this package's own code, fetch only from this controller, and are never
# framed by another page.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str | None = Field(None, min_length=1, max_length=512)
    code: str | None = Field(None, min_length=1, max_length=128)


class LoginCode(BaseModel):
    code: str
    expires_in: float = Field(description="seconds; the code works once")


CODE_SECONDS = 120.0
MAX_CODES = 100


class LoginCodes:
    """One-time codes for login links (`fleetserve dashboard`): a link shown in a terminal or
    handed to a browser's command line (which other local users can read) then gives away
    nothing that lasts: its code works once, within two minutes."""

    def __init__(self) -> None:
        self._codes: dict[str, float] = {}  # code -> expiry

    def issue(self, now: float) -> str:
        self._codes = {c: t for c, t in self._codes.items() if t > now}
        while len(self._codes) >= MAX_CODES:  # the oldest go first
            del self._codes[min(self._codes, key=self._codes.__getitem__)]
        code = secrets.token_urlsafe(24)
        self._codes[code] = now + CODE_SECONDS
        return code

    def redeem(self, code: str, now: float) -> bool:
        for known in list(self._codes):
            if hmac.compare_digest(known.encode(), code.encode()):
                return self._codes.pop(known) > now
        return False


def _read(name: str) -> bytes:
    return resources.files("fleetserve.api").joinpath("static", name).read_bytes()


def add_dashboard(app: FastAPI, token: str, sessions: Sessions, secure_cookie: bool) -> None:
    """Routes: `/` (the dashboard, or a redirect to the login page), `/login`, the login and
    logout calls, and the static files."""
    pages = {name: _read(name) for name in ("index.html", "login.html")}
    codes = LoginCodes()
    files = {name: _read(name) for name in STATIC}

    def page(name: str) -> Response:
        return Response(
            pages[name], media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS
        )

    def signed_in(request: Request) -> bool:
        return sessions.valid(cookie(request.scope.get("headers", [])), time.time())

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        if not signed_in(request):
            return RedirectResponse("/login", status_code=303, headers=SECURITY_HEADERS)
        return page("index.html")

    @app.get("/login", include_in_schema=False)
    async def login_page() -> Response:
        return page("login.html")

    @app.post("/api/v1/dashboard/login-codes", response_model=LoginCode, status_code=201)
    async def login_code() -> LoginCode:
        """A one-time code for a login link (needs the API token, like every write)."""
        return LoginCode(code=codes.issue(time.time()), expires_in=CODE_SECONDS)

    @app.post("/ui/login", include_in_schema=False)
    async def login(body: Login) -> Response:
        if body.code is not None:
            ok, why = codes.redeem(body.code, time.time()), "that login link is used or expired"
        else:
            given = (body.token or "").strip().encode()
            ok = hmac.compare_digest(given, token.encode())
            why = "that is not this controller's token"
        if not ok:
            return JSONResponse(
                {"error": {"kind": "unauthorized", "message": why}},
                status_code=401,
                headers=SECURITY_HEADERS,
            )
        resp = JSONResponse({"ok": True}, headers=SECURITY_HEADERS)
        resp.set_cookie(
            SESSION_COOKIE,
            sessions.issue(time.time()),
            max_age=SESSION_SECONDS,
            path="/",
            httponly=True,
            samesite="strict",
            secure=secure_cookie,
        )
        return resp

    @app.post("/ui/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        sessions.revoke(cookie(request.scope.get("headers", [])), time.time())
        resp = JSONResponse({"ok": True}, headers=SECURITY_HEADERS)
        resp.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure_cookie
        )
        return resp

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in files:
            return JSONResponse(
                {"error": {"kind": "not_found", "message": f"no file {name[:64]!r}"}},
                status_code=404,
            )
        return Response(files[name], media_type=STATIC[name], headers=SECURITY_HEADERS)
