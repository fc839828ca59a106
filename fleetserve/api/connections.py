"""Who may hold a connection to the controller's API, and for how long.

uvicorn bounds the size of a request's head but not the time a client takes to send it, nor
how many connections one client holds; a few hundred connections that trickle header lines
(or stall their TLS handshake, or sit idle between requests) used to take every slot of
`limit_concurrency`, and the API answered 503 to everyone. `GuardedH11Protocol` (uvicorn's
h11 protocol with an admission step) closes that:

- **Deadline.** A connection has `header_seconds` from its accept to finish its TLS handshake
  and the head of its first request; each later request on it has as long from its first
  byte. Past it: `408` and close (a handshake not done: closed). Bodies have their own
  deadline (fleetserve.api.auth); idle keep-alive connections uvicorn's `timeout_keep_alive`.
- **Anonymous connections are bounded.** Until a request on it carries the API token (or a
  dashboard session), a connection is anonymous. One client (a network address; on loopback,
  the address and the uid of the process that connected, asked of the kernel) holds at
  most `max_per_client` anonymous connections, and all clients together 3/4 of
  `max_connections`: the rest is room for token holders. A new connection past a bound
  pushes out the oldest anonymous connection that is not in the middle of a request, of the
  same client (per-client bound) or of the client holding the most (total bound), so a
  client that sends its request at once always gets through; with none to push out it is
  answered `503` (a TLS one: closed) at once.

TLS is set up here (the event loop's own TLS protocol) rather than by the server, so that a
handshake counts as a connection from its first byte and has the same deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import time
from asyncio import sslproto
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from fleetserve.core.sockets import tcp_uid

log = logging.getLogger("fleetserve.controller")

HEADER_SECONDS = 10.0
MAX_CONNECTIONS = 512
MAX_PER_CLIENT = 32
LOG_EVERY = 60.0  # seconds between two log lines about refused or timed-out connections

ClientKey = tuple[str, int | None]  # (address, uid on loopback else None)


def anonymous_share(max_connections: int) -> int:
    """How many connections may be anonymous at once: the rest is for token holders."""
    return max(1, max_connections * 3 // 4)


def _answer(status: int, reason: str, kind: str, message: str) -> bytes:
    body = json.dumps({"error": {"kind": kind, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


def _is_loopback(address: str) -> bool:
    return (
        address.startswith("127.")
        or address in ("::1", "::ffff:127.0.0.1")
        or (address.startswith("::ffff:127."))
    )


class Admission:
    """The bookkeeping shared by every connection of one API server."""

    def __init__(
        self,
        trusted: Callable[[list[tuple[bytes, bytes]]], bool],
        *,
        tls: ssl.SSLContext | None = None,
        header_seconds: float = HEADER_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_PER_CLIENT,
        uid_of: Callable[[str, int, str, int], int | None] = tcp_uid,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trusted = trusted  # whether a request's headers carry the token (or a session)
        self.tls = tls
        self.header_seconds = header_seconds
        self.max_anonymous = anonymous_share(max_connections)
        self.max_per_client = max_per_client
        self.uid_of = uid_of
        self.clock = clock
        # Anonymous connections by client, oldest first (dicts keep insertion order).
        self.clients: dict[ClientKey, dict[GuardedH11Protocol, None]] = {}
        self.anonymous = 0
        self.counts: dict[str, int] = {}  # refused / pushed_out / timed_out / handshake_failed
        self._logged: dict[str, float] = {}

    def count(self, what: str, detail: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        now = self.clock()
        if now - self._logged.get(what, -LOG_EVERY) >= LOG_EVERY:
            self._logged[what] = now
            log.warning(
                "API connections %s: %s (%d so far; logged once a minute)",
                what.replace("_", " "),
                detail,
                self.counts[what],
            )

    def client_of(self, transport: asyncio.BaseTransport) -> ClientKey:
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        if not isinstance(peer, tuple) or len(peer) < 2:
            return ("?", None)
        address = str(peer[0])
        if _is_loopback(address) and isinstance(local, tuple) and len(local) >= 2:
            # The peer's socket is on this machine: whose it is (its uid) tells local users
            # apart, who all connect from 127.0.0.1.
            return (address, self.uid_of(address, int(peer[1]), str(local[0]), int(local[1])))
        return (address, None)

    def admit(self, conn: GuardedH11Protocol, key: ClientKey) -> bool:
        """Register a new connection as anonymous, pushing out an older one past a bound;
        False if there is no room for it."""
        mine = self.clients.get(key)
        if mine is not None and len(mine) >= self.max_per_client:
            if not self._push_out(mine.keys()):
                self.count("refused", f"{_who(key)} holds {len(mine)} (the per-client bound)")
                return False
        elif self.anonymous >= self.max_anonymous:
            heaviest = sorted(self.clients.values(), key=len, reverse=True)
            if not any(self._push_out(group.keys()) for group in heaviest):
                self.count("refused", f"{self.anonymous} anonymous connections (the bound)")
                return False
        self.clients.setdefault(key, {})[conn] = None
        self.anonymous += 1
        return True

    def _push_out(self, group: Iterable[GuardedH11Protocol]) -> bool:
        for victim in group:
            if not victim.busy():
                self.forget(victim)
                victim.push_out()
                self.count("pushed_out", f"the oldest idle one of {_who(victim.key)}")
                return True
        return False

    def forget(self, conn: GuardedH11Protocol) -> None:
        """The connection is no longer anonymous (closed, or it showed the token)."""
        group = self.clients.get(conn.key)
        if group is None or conn not in group:
            return
        del group[conn]
        self.anonymous -= 1
        if not group:
            del self.clients[conn.key]


def _who(key: ClientKey) -> str:
    address, uid = key
    return f"{address} (uid {uid})" if uid is not None else address


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol behind `Admission` (subclassed per server by
    `protocol_class`, which sets `admission`)."""

    admission: ClassVar[Admission]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key: ClientKey = ("?", None)
        self._raw: asyncio.Transport | None = None
        self._made = False  # uvicorn's connection_made ran (after the TLS handshake)
        self._deadline: asyncio.TimerHandle | None = None

    # -- admission -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._raw is not None:  # the TLS layer's transport, its handshake done
            self._made = True
            super().connection_made(transport)
            return
        guard = self.admission
        self._raw = transport
        self.key = guard.client_of(transport)
        if not guard.admit(self, self.key):
            if guard.tls is None:
                message = "the controller has too many connections open: retry in a second"
                transport.write(_answer(503, "Service Unavailable", "transient", message))
                transport.close()
            else:
                transport.abort()
            return
        self._arm()
        if guard.tls is None:
            self._made = True
            super().connection_made(transport)
            return
        # TLS between the socket and this protocol, set up now (before the loop reads a byte
        # of the socket), as the server itself would: its handshake is timed from the accept
        # and this protocol's connection_made is called again once it is done.
        waiter: asyncio.Future[None] = self.loop.create_future()
        waiter.add_done_callback(self._handshake_done)
        tls = _tls_protocol(self.loop)(
            self.loop,
            self,
            guard.tls,
            waiter,
            server_side=True,
            ssl_handshake_timeout=guard.header_seconds + 1,  # our own deadline comes first
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)

    def _handshake_done(self, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled():
            self._closed()
            return
        failed = waiter.exception()  # retrieved: a failed handshake is no error of ours
        if failed is not None:
            self.admission.count("handshake_failed", f"{_who(self.key)}: {type(failed).__name__}")
            self._closed()
            if self._raw is not None:
                self._raw.abort()

    def busy(self) -> bool:
        """In the middle of a request (its answer not sent yet)."""
        return self._made and self.cycle is not None and not self.cycle.response_complete

    def push_out(self) -> None:
        """Closed to make room for a newer connection."""
        self._disarm()
        target = self.transport if self._made else self._raw
        if target is not None:
            target.abort()

    # -- the head's deadline ----------------------------------------------------------------

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.admission.header_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        guard = self.admission
        if not self._made:
            guard.count("timed_out", f"a TLS handshake from {_who(self.key)}")
            self._closed()
            if self._raw is not None:
                self._raw.abort()
            return
        if self.busy() or self.transport.is_closing():
            return
        guard.count("timed_out", f"a request head from {_who(self.key)}")
        message = f"the request's head did not arrive within {guard.header_seconds:g} s"
        self.transport.write(_answer(408, "Request Timeout", "timeout", message))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.busy():  # the first bytes of a request: its head is due in time
            self._arm()
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:  # a request's head arrived
            self._disarm()
            if self.admission.trusted(self.headers):
                self.admission.forget(self)

    def _closed(self) -> None:
        self._disarm()
        self.admission.forget(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        if self._made:
            super().connection_lost(exc)


def _tls_protocol(loop: asyncio.AbstractEventLoop) -> Any:
    """The TLS protocol class of this event loop (uvloop has its own)."""
    try:
        import uvloop

        if isinstance(loop, uvloop.Loop):
            return uvloop.loop.SSLProtocol  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass
    return sslproto.SSLProtocol


def protocol_class(admission: Admission) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`http=`), bound to one server's `admission`."""
    return type("ControllerH11Protocol", (GuardedH11Protocol,), {"admission": admission})


def token_check(
    token: str, session_valid: Callable[[str | None, float], bool] | None = None
) -> Callable[[list[tuple[bytes, bytes]]], bool]:
    """Whether a request's headers carry the API token (or a valid dashboard session)."""
    from fleetserve.api.auth import bearer, cookie

    expected = token.encode()

    def trusted(headers: list[tuple[bytes, bytes]]) -> bool:
        given = bearer(headers)
        if given is not None:
            return hmac.compare_digest(given.encode(), expected)
        return session_valid is not None and session_valid(cookie(headers), time.time())

    return trusted
