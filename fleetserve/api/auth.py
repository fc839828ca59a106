"""Who may call the REST API: the token, the Host allow-list and JSON-only writes.

Every route but `/api/v1/health` needs `Authorization: Bearer <token>`; the dashboard's reads
may carry its session cookie instead (made by logging in with the token; never good for a
write). The token is made at
the controller's first start into a 0600 file in the 0700 home, so only the user who owns the
home (and root) can read it; the CLI and SDK of that user read it, others pass it in
FLEETSERVE_API_TOKEN. The Host header must name this controller (a DNS-rebinding page cannot
reach it through a name of its own) and a browser's foreign Origin is refused. State-changing
calls must be JSON: a form or a body-less cross-site POST never gets through. The load
balancer's wake-up call carries its own per-service secret instead of the token.
See docs/security.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import psutil

from fleetserve.controller.settings import Settings
from fleetserve.home.settings import LOOPBACK_HOSTS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/api/v1/health"})
# The dashboard's own pages check the session themselves (fleetserve.api.dashboard): "/" sends
# a visitor without one to the login page; the login call takes the token in its JSON body.
DASHBOARD_PATHS = frozenset({"/", "/login", "/ui/login", "/ui/logout"})
STATIC_PREFIX = "/ui/static/"  # the dashboard's code and style: no data in them
READ_METHODS = frozenset({"GET", "HEAD"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SESSION_COOKIE = "fleetserve_session"
SESSION_SECONDS = 12 * 3600


def _session_mac(token: str, body: str) -> str:
    key = hashlib.sha256(f"fleetserve-dashboard-session:{token}".encode()).digest()
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


_SESSION = re.compile(r"^([0-9]{1,12})\.([A-Za-z0-9_-]{16})\.([0-9a-f]{64})$")


class Sessions:
    """The dashboard's session cookies: `<expiry>.<id>.<MAC of both keyed by the API token>`.

    A cookie is not the token (a leaked one expires, and says nothing of the token), a new
    token ends every session, and logging out revokes that session's id here (kept until it
    would have expired, in memory: a restarted controller forgets revocations, the expiry
    still holds)."""

    def __init__(self, token: str, max_revoked: int = 10_000) -> None:
        self.token = token
        self.max_revoked = max_revoked
        self._revoked: dict[str, int] = {}  # session id -> its expiry

    def issue(self, now: float) -> str:
        body = f"{int(now) + SESSION_SECONDS}.{secrets.token_urlsafe(12)}"
        return f"{body}.{_session_mac(self.token, body)}"

    def _parse(self, value: str | None, now: float) -> tuple[int, str] | None:
        m = _SESSION.fullmatch(value or "")
        if m is None:
            return None
        expires, sid, mac = int(m.group(1)), m.group(2), m.group(3)
        if expires < now or expires > now + SESSION_SECONDS + 60:
            return None
        good = _session_mac(self.token, f"{m.group(1)}.{sid}")
        if not hmac.compare_digest(mac.encode(), good.encode()):
            return None
        return expires, sid

    def valid(self, value: str | None, now: float) -> bool:
        parsed = self._parse(value, now)
        return parsed is not None and parsed[1] not in self._revoked

    def revoke(self, value: str | None, now: float) -> None:
        parsed = self._parse(value, now)
        if parsed is None:
            return
        self._revoked = {sid: exp for sid, exp in self._revoked.items() if exp >= now}
        while len(self._revoked) >= self.max_revoked:  # the soonest to expire go first
            del self._revoked[min(self._revoked, key=self._revoked.__getitem__)]
        self._revoked[parsed[1]] = parsed[0]


def cookie(headers: Iterable[tuple[bytes, bytes]], name: str = SESSION_COOKIE) -> str | None:
    """The value of cookie `name` (the last one if a client sent it twice)."""
    found = None
    for key, value in headers:
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                if k == name:
                    found = v.strip()
    return found


_WAKE = re.compile(r"^/api/v1/services/([^/]+)/wake$")


def allowed_host_names(settings: Settings) -> frozenset[str]:
    """The names the Host header may carry: loopback ones, those configured, and, when the API
    listens beyond loopback, this machine's names and addresses."""
    names = {*LOOPBACK_HOSTS, "[::1]", *settings.allowed_hosts}
    if settings.api_host not in LOOPBACK_HOSTS:
        names |= {socket.gethostname(), socket.getfqdn()}
        if settings.api_host not in ("0.0.0.0", "::"):
            names.add(settings.api_host)
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    ip = a.address.split("%", 1)[0]
                    names.add(f"[{ip}]" if ":" in ip else ip)
    return frozenset(n.lower() for n in names)


_HOST = re.compile(r"^(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]{1,5})?$")


def host_name(value: str) -> str:
    """`example.com:8080` -> `example.com`; `[::1]:80` -> `[::1]`; anything that is not a
    plain host with an optional numeric port -> "" (never allowed)."""
    m = _HOST.match(value.strip().lower())
    return m.group(1) if m else ""


def origin_host(origin: str) -> str:
    """The host of an Origin header, "" if it is not a plain scheme://host[:port]."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or "@" in parts.netloc or parts.path not in ("", "/"):
        return ""
    return host_name(parts.netloc)


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for key, value in headers:
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _same(given: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(given.encode(), expected.encode())


class ApiGuard:
    """ASGI middleware: Host, Origin, token (or an LB's wake secret), JSON-only writes."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        hosts: frozenset[str],
        wake_secret: Callable[[str], str | None],
        max_body: int = 2 * 1024 * 1024,
        sessions: Sessions | None = None,
        body_seconds: float = 10.0,
    ) -> None:
        self.app = app
        self.token = token
        self.sessions = sessions or Sessions(token)  # the dashboard's (shared with its routes)
        self.body_seconds = body_seconds
        self.hosts = hosts
        self.wake_secret = wake_secret  # the service's LB secret, for its wake-up calls
        self.max_body = max_body  # bytes; a larger body is answered 413 unread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        problem = self.check(scope["method"], scope["path"], headers)
        if problem is None and scope["path"] in OPEN_PATHS:
            # An open route says more to a caller with the token (`request.state.token_ok`).
            given = bearer(headers)
            ok = given is not None and _same(given, self.token)
            scope.setdefault("state", {})["token_ok"] = ok
        if problem is None and scope["method"] in WRITE_METHODS:
            # Bodies are read here, whole and bounded in size and time, before anything
            # parses them: a client that trickles one holds a connection for seconds, not
            # forever.
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_seconds)
            except TimeoutError:
                message = f"the request body did not arrive within {self.body_seconds:g} s"
                await self._refuse(send, 408, "timeout", message)
                return
            if body is None:
                problem = 413, "too_large", f"the request body exceeds {self.max_body} bytes"
            else:
                replay = [{"type": "http.request", "body": body, "more_body": False}]

                async def receive_body() -> Message:
                    return replay.pop() if replay else await receive()

                await self.app(scope, receive_body, send)
                return
        if problem is None:
            await self.app(scope, receive, send)
            return
        await self._refuse(send, *problem)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None past `max_body` bytes (or if the client went away)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send: Send, status: int, kind: str, message: str) -> None:
        body = json.dumps({"error": {"kind": kind, "message": message}}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def check(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> tuple[int, str, str] | None:
        """None if the request may go on, else (HTTP status, error kind, message)."""
        values: dict[bytes, str] = {}
        for k, v in headers:
            key = k.lower()
            if key in values and key in (b"host", b"origin", b"authorization"):
                return 400, "bad_request", f"more than one {key.decode()} header"
            values[key] = v.decode("latin-1")
        raw_host = values.get(b"host", "")
        host = host_name(raw_host)
        if not host or host not in self.hosts:
            return 421, "bad_host", f"this controller does not serve the host {raw_host[:100]!r}"
        origin = values.get(b"origin")
        if origin is not None and origin_host(origin) not in self.hosts:
            return 403, "forbidden", f"requests from the origin {origin[:100]!r} are refused"
        if (
            path not in OPEN_PATHS
            and path not in DASHBOARD_PATHS
            and not (path.startswith(STATIC_PREFIX) and method in READ_METHODS)
        ):
            given = bearer(headers)
            # The dashboard reads the API with its session cookie; it never writes with it
            # (no request forged by another site can change anything).
            if (
                given is None
                and method in READ_METHODS
                and self.sessions.valid(cookie(headers), time.time())
            ):
                return None
            if given is None:
                return 401, "unauthorized", "missing `Authorization: Bearer <token>`"
            if not _same(given, self.token):
                m = _WAKE.fullmatch(path)
                if not (m and method == "POST" and _same(given, self.wake_secret(m.group(1)))):
                    return 401, "unauthorized", "the API token is wrong"
        if method in WRITE_METHODS:
            ctype = values.get(b"content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return 415, "unsupported_media_type", "state-changing calls take JSON only"
            length = values.get(b"content-length", "0").strip() or "0"
            if not length.isdigit() or int(length) > self.max_body:
                return 413, "too_large", f"the request body exceeds {self.max_body} bytes"
        return None
