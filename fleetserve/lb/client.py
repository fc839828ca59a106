"""The client side of the proxy: one connection's requests, parsed only to find where each
ends and answered in order (pipelining).

No client can make it hold more than its `Limits` (from `service.load_balancer`): a request's
head is bounded in bytes, lines and URL length while it is parsed, at most
`max_pipelined_requests` wait per connection (then the socket is not read), connections per
process are capped, and the proxy's sweep closes heads that take too long and idle keep-alive
connections. All of it applies before an API key is looked at.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NoReturn, Protocol

import httptools

from fleetserve.lb.exchange import Exchange, ExchangeContext
from fleetserve.lb.http import (
    FRAMING,
    HIGH_WATER,
    HOP_BY_HOP,
    MIN_HEAD_BYTES,
    connection_tokens,
    error_response,
)
from fleetserve.lb.metrics import Rejection
from fleetserve.lb.priority import PRIORITY


class Listener(Protocol):
    """What a client connection needs of the process that accepted it (fleetserve.lb.proxy):
    the open connections, their limits and the API keys. (What its exchanges share comes
    apart, as their `ExchangeContext`.)"""

    @property
    def clients(self) -> set[ClientConn]: ...

    @property
    def max_connections(self) -> int: ...

    @property
    def busy(self) -> bytes: ...

    @property
    def per_client(self) -> dict[bytes, int]: ...

    @property
    def per_client_limit(self) -> int | None: ...

    @property
    def busy_client(self) -> bytes: ...

    @property
    def keys(self) -> list[bytes]: ...

    @property
    def draining(self) -> bool: ...

    def authorized(self, header: bytes | None) -> bool: ...


# While a connection's queue is full its requests wait unparsed, up to this much; past it the
# socket is not read (reading on until then shows a client that leaves at once).
BACKLOG_BYTES = 64 * 1024


class _Refused(Exception):
    """A request the load balancer answers itself, then closes the connection."""

    def __init__(self, status: int, code: str, message: str, reason: Rejection) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.reason = reason


class ClientConn(asyncio.Protocol):
    """One client connection: parses its requests (within `Limits`), answers them in order."""

    def __init__(self, listener: Listener, ctx: ExchangeContext) -> None:
        self.listener = listener  # the process that accepted it (its connections, keys)
        self.ctx = ctx
        self.limits = ctx.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Exchange] = deque()  # pipelined requests wait their turn
        self.building: Exchange | None = None
        self.tunnel: Exchange | None = None
        self.starting: Exchange | None = None
        self.closed = False
        # Reading stops while any of these holds; `reading` is what the transport does.
        self.paused = False  # flow control: a body waits for a replica, or its socket is full
        self.held = False  # the queue is full and so is `backlog`
        self.dead = False  # refused (or over the connection limit): nothing more is read
        self.reading = True
        # The head in progress, for the limits and the header timeout.
        self.in_head = False
        self.head_started = 0.0
        self.read_bytes = 0  # the size of the read being parsed
        self.head_first = 0  # how much of the head in progress its first read held at most
        self.head_bytes = 0  # bytes of the reads that began inside it
        self.idle_since = ctx.clock
        self.full = False  # `limits.pipelined` requests are queued: what comes waits unparsed
        self.backlog = b""  # what came while `full`, parsed once the queue drains
        self.upgrading = False
        # A chunked body's trailer fields are bounded as a head's fields are, and so are the
        # bytes that bring no body byte while a chunked body is in progress (a trailer line or
        # a chunk extension that never ends): `framing` of them in a row.
        self.trailer_bytes = 0
        self.trailer_count = 0
        self.framing = 0
        self.body_moved = False
        self._refused: _Refused | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.peer = b""
        self.counted = False  # counted in listener.per_client
        self.scheme = b"http"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        listener = self.listener
        if len(listener.clients) >= listener.max_connections:
            # Refused before it costs anything more than this answer (the kernel has already
            # accepted it): better than running out of file descriptors for everyone.
            self.dead = self.closed = True
            self.ctx.metrics.rejected(Rejection.CONNECTIONS)
            self.transport.write(listener.busy)  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]
            return
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]).encode() if peer else b""
        if listener.per_client_limit is not None:
            held = listener.per_client.get(self.peer, 0)
            if held >= listener.per_client_limit:  # one address must not take every connection
                self.dead = self.closed = True
                self.ctx.metrics.rejected(Rejection.CLIENT_CONNECTIONS)
                self.transport.write(listener.busy_client)  # type: ignore[union-attr]
                self.transport.close()  # type: ignore[union-attr]
                return
            listener.per_client[self.peer] = held + 1
            self.counted = True
        listener.clients.add(self)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]
        self.scheme = b"https" if transport.get_extra_info("sslcontext") else b"http"

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel.tunnel_from_client(data)
            return
        if self.dead:
            return
        if self.full:
            self._keep(data)
            return
        if (self.queue or len(data) >= self.limits.small_read) and self._may_fill(data):
            self._feed_heads(data)
        else:  # what _feed does, inlined: this runs for every read
            self.read_bytes = len(data)
            if self.in_head:
                self.head_bytes += len(data)
            self.body_moved = False
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                self._upgraded_at(e, data)
            except httptools.HttpParserError as e:
                self._parse_failed(e)
            else:
                if self.in_head and self.head_bytes > self.limits.head_bytes:
                    self._refuse(self._too_large(Rejection.HEADER_BYTES))
                elif not self.body_moved and self._framing_over(len(data)):
                    self._parse_failed(None)
        if self.starting is not None:
            ex, self.starting = self.starting, None
            self._start(ex)

    def _may_fill(self, data: bytes) -> bool:
        """Whether this read may complete more heads than the queue has room for (a read that
        continues a body is parsed whole: past the room, a request gets a 429)."""
        building = self.building
        if building is not None and not building.body.complete:
            return False
        room = self.limits.pipelined - len(self.queue)
        return len(data) >= (room - 1) * MIN_HEAD_BYTES and data.count(b"\r\n\r\n") >= room

    def _feed_heads(self, data: bytes) -> None:
        """Feed the parser up to one head's end at a time; once `limits.pipelined` requests
        wait, keep the rest of the read until the queue drains."""
        start = 0
        while start < len(data):
            if self.full:
                self._keep(data[start:])
                return
            end = data.find(b"\r\n\r\n", start)
            stop = len(data) if end < 0 else end + 4
            if not self._feed(data[start:stop]):
                if self.upgrading and self.building is not None and stop < len(data):
                    self.building.tunnel_from_client(data[stop:])
                return
            start = stop

    def _keep(self, data: bytes) -> None:
        self.backlog += data
        if len(self.backlog) >= BACKLOG_BYTES and not self.held:
            self.held = True  # back-pressure: the next requests wait in the socket
            self._sync_reading()

    def _feed(self, data: bytes) -> bool:
        """Parse `data`; False once the parser stopped (refused, or the request upgrades)."""
        self.read_bytes = len(data)
        if self.in_head:
            self.head_bytes += len(data)
        self.body_moved = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self._upgraded_at(e, data)
            return False
        except httptools.HttpParserError as e:
            self._parse_failed(e)
            return False
        # A header line that never ends is held by the parser until it does: what it has not
        # shown yet is bounded here, once per read.
        if self.in_head and self.head_bytes > self.limits.head_bytes:
            self._refuse(self._too_large(Rejection.HEADER_BYTES))
            return False
        if not self.body_moved and self._framing_over(len(data)):
            self._parse_failed(None)
            return False
        return True

    def _framing_over(self, size: int) -> bool:
        """Whether a chunked body in progress has now had more than the head's limit of bytes
        in a row without a body byte (a trailer or a chunk line that never ends: the parser
        holds it whole, and joins it by copying)."""
        ex = self.building
        if ex is None or not ex.chunked or ex.body.complete or self.in_head:
            self.framing = 0
            return False
        self.framing += size
        if self.framing <= self.limits.head_bytes:
            return False
        self._refused = self._too_large(Rejection.HEADER_BYTES)
        return True

    def _upgraded_at(self, e: httptools.HttpParserUpgrade, data: bytes) -> None:
        """The request asks for an upgrade: what follows its head is the tunnel's."""
        self.upgrading = True
        ex = self.building
        offset = e.args[0] if e.args and isinstance(e.args[0], int) else len(data)
        if ex is not None and offset < len(data):
            ex.tunnel_from_client(data[offset:])

    def _parse_failed(self, e: httptools.HttpParserError | None) -> None:
        refused, self._refused = self._refused, None
        if refused is None:
            # llhttp is strict: ambiguous framing (Content-Length with Transfer-Encoding,
            # two Content-Lengths, an obfuscated Transfer-Encoding, bare LF) ends here.
            refused = _Refused(
                400, "bad_request", f"malformed HTTP request: {e}", Rejection.BAD_REQUEST
            )
        ex = self.building
        if ex is not None and not ex.body.complete and ex in self.queue:
            # A broken body: its request cannot complete. Answer if nothing was, and close
            # (connection_lost cancels the replica's request).
            self.dead = True
            self.ctx.metrics.rejected(refused.reason)
            if self.starting is ex:
                self.starting = None
            if self.queue[0] is ex and not ex.sent_to_client:
                self.write(error_response(refused.status, refused.code, refused.message, True))
            self.close_after_write()
            return
        self._refuse(refused)

    def _refuse(self, refused: _Refused) -> None:
        """Answer `refused` after the requests queued before it, read nothing more, close."""
        self.dead = True
        self.in_head = False
        self._sync_reading()
        self.ctx.metrics.rejected(refused.reason)
        ex = Exchange(self.ctx, self, b"", b"", False)
        ex.local = error_response(refused.status, refused.code, refused.message, close=True)
        ex.keep_alive = False
        self.queue.append(ex)
        if len(self.queue) == 1:
            self._start(ex)

    def _stop(self, refused: _Refused) -> NoReturn:
        """Stop the parser from one of its callbacks (it raises out of feed_data)."""
        self._refused = refused
        raise refused

    def _too_large(self, reason: Rejection) -> _Refused:
        limits = self.limits
        return _Refused(
            431,
            "request_header_fields_too_large",
            f"a request's headers are limited to {limits.header_bytes} bytes "
            f"and {limits.header_count} lines",
            reason,
        )

    # parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self.trailer_bytes = self.trailer_count = self.framing = 0
        self.in_head = True
        self.head_started = self.ctx.clock
        self.head_first = self.read_bytes  # at most this much of the head is in this read
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.url_bytes:
            self._stop(
                _Refused(
                    414,
                    "uri_too_long",
                    f"a request's URL is limited to {self.limits.url_bytes} bytes",
                    Rejection.URL_BYTES,
                )
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self._headers.append((name, value))
            return
        # A trailer field, after a chunked body: not passed on, but bounded as a head is.
        self.trailer_count += 1
        self.trailer_bytes += len(name) + len(value) + 4
        limits = self.limits
        if self.trailer_count > limits.header_count:
            self._stop(self._too_large(Rejection.HEADER_COUNT))
        if self.trailer_bytes > limits.header_bytes:
            self._stop(self._too_large(Rejection.HEADER_BYTES))

    def on_headers_complete(self) -> None:
        self.in_head = False
        listener = self.listener
        parser = self.parser
        headers = self._headers
        limits = self.limits
        if (
            self.head_first + self.head_bytes > limits.header_bytes
            or len(headers) > limits.header_count
        ):
            self._check_head_size(headers)  # it may be over a limit (most heads cannot be)
        lower = {n.lower(): v for n, v in headers}
        keep_alive = parser.should_keep_alive()
        has_connection = b"connection" in lower
        # llhttp admits HTTP 0.9, 1.0, 1.1 and 2.0: only 1.1 keeps alive without a Connection
        # header, so the version string is only made for the others.
        http10 = not (keep_alive and not has_connection) and self._http10()
        host = lower.get(b"host")
        if http10 or host is None or len(lower) < len(headers):
            self._check_host_and_framing(headers, lower, http10)
        queued = len(self.queue)
        if queued >= limits.pipelined:
            # Only a read that continues a body and then carries more requests than the queue
            # takes gets here (see data_received).
            self._stop(
                _Refused(
                    429,
                    "too_many_pipelined_requests",
                    f"at most {limits.pipelined} requests wait on one connection",
                    Rejection.PIPELINED,
                )
            )
        method = parser.get_method()
        if method == b"CONNECT":
            self._stop(
                _Refused(
                    405,
                    "method_not_allowed",
                    "CONNECT is not served: this is a load balancer, not a forward proxy",
                    Rejection.BAD_REQUEST,
                )
            )
        upgrade = parser.should_upgrade()
        te = lower.get(b"transfer-encoding")
        chunked = False
        if te is not None:
            chunked = self._check_transfer_encoding(headers)
        has_body = chunked or int(lower.get(b"content-length", b"0") or 0) > 0
        if upgrade and has_body:
            # The parser hands what follows the head to the tunnel: such a body would wait
            # for a 101 that its replica, waiting for the body, never sends (an h2c upgrade).
            self._stop(self._bad("an Upgrade request with a body is not served"))
        strip_auth = bool(listener.keys)
        drop = HOP_BY_HOP
        if has_connection:
            drop = drop | (connection_tokens(headers) - FRAMING)
        if self.ctx.priority is not None:
            drop = drop | PRIORITY  # engine_priority: the LB's hint replaces the client's
        out = [method, b" ", self._url, b" HTTP/1.1\r\n"]
        for name, value in headers:
            ln = name.lower()
            if ln in drop or (strip_auth and ln == b"authorization") or ln == b"transfer-encoding":
                continue
            out += (name, b": ", value, b"\r\n")
        if te is not None:
            # One line: a replica that reads only the first of several would frame the body
            # otherwise than the load balancer does.
            codings = b", ".join(v for n, v in headers if n.lower() == b"transfer-encoding")
            out += (b"Transfer-Encoding: ", codings, b"\r\n")
        prior = lower.get(b"x-forwarded-for")
        if prior is not None and len(lower) < len(headers):
            # Several X-Forwarded-For lines are one list, in their order (RFC 9110 5.3).
            prior = b", ".join(v for n, v in headers if n.lower() == b"x-forwarded-for")
        out += (b"X-Forwarded-For: ", prior + b", " + self.peer if prior else self.peer, b"\r\n")
        out += (b"X-Forwarded-Proto: ", self.scheme, b"\r\n")
        if host is not None:
            out += (b"Host: ", host, b"\r\nX-Forwarded-Host: ", host, b"\r\n")
        else:  # HTTP/1.0 may leave it out; the replica gets HTTP/1.1, which needs one
            out += (b"Host: ", self._local_host(), b"\r\n")
        if upgrade:
            out += (b"Connection: upgrade\r\nUpgrade: ", lower.get(b"upgrade", b""), b"\r\n")
        out.append(b"\r\n")
        ex = Exchange(self.ctx, self, method, b"".join(out), has_body, lower)
        ex.chunked = chunked
        ex.keep_alive = keep_alive
        ex.http10 = http10
        ex.wants_upgrade = upgrade
        if not listener.authorized(lower.get(b"authorization")):
            ex.local = error_response(
                401,
                "unauthorized",
                "a valid API key is required: Authorization: Bearer <key>",
                close=has_body or not ex.keep_alive,
                extra={"WWW-Authenticate": "Bearer"},
            )
            if has_body:
                ex.keep_alive = False
        self.building = ex
        self.queue.append(ex)
        if not queued:
            # Started once this read is parsed, so that the part of the body that came with
            # the head goes to the replica in the same send.
            self.starting = ex
        elif queued + 1 >= limits.pipelined:
            self.full = True

    def _check_host_and_framing(
        self, headers: list[tuple[bytes, bytes]], lower: dict[bytes, bytes], http10: bool
    ) -> None:
        if b"host" not in lower and not http10:
            self._stop(self._bad("an HTTP/1.1 request needs a Host header"))
        if sum(n.lower() == b"host" for n, _ in headers) > 1:
            self._stop(self._bad("a request has one Host header"))
        if http10 and b"transfer-encoding" in lower:
            self._stop(self._bad("an HTTP/1.0 request has no Transfer-Encoding"))  # RFC 9112 6.1

    def _check_transfer_encoding(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A request's Transfer-Encoding must end with chunked (RFC 9112 6.3): anything else
        cannot be framed and is refused here, before a replica sees the request (the parser
        says so only after the head, once it has been queued). True: the body is chunked."""
        codings = [
            c.strip().lower()
            for n, v in headers
            if n.lower() == b"transfer-encoding"
            for c in v.split(b",")
        ]
        if not codings or codings[-1] != b"chunked":
            self._stop(self._bad("a request's Transfer-Encoding must end with chunked"))
        return True

    def _check_head_size(self, headers: list[tuple[bytes, bytes]]) -> None:
        limits = self.limits
        if len(headers) > limits.header_count:
            self._stop(self._too_large(Rejection.HEADER_COUNT))
        if sum(len(n) + len(v) + 4 for n, v in headers) > limits.header_bytes:
            self._stop(self._too_large(Rejection.HEADER_BYTES))

    def _http10(self) -> bool:
        """Whether the request is HTTP/1.0; refused unless it is that or HTTP/1.1."""
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            self._stop(
                _Refused(
                    505,
                    "http_version_not_supported",
                    f"HTTP/{version} is not served here: use HTTP/1.1",
                    Rejection.HTTP_VERSION,
                )
            )
        return version == "1.0"

    def _bad(self, message: str) -> _Refused:
        return _Refused(400, "bad_request", message, Rejection.BAD_REQUEST)

    def _local_host(self) -> bytes:
        sock = self.transport.get_extra_info("sockname") if self.transport else None
        if not sock:
            return b"localhost"
        host = str(sock[0])
        return (f"[{host}]:{sock[1]}" if ":" in host else f"{host}:{sock[1]}").encode()

    def on_body(self, body: bytes) -> None:
        self.body_moved = True
        self.framing = 0
        if self.building is not None:
            self.building.on_body(body)

    def on_message_complete(self) -> None:
        if self.building is not None:
            self.building.on_body_complete()

    def _start(self, ex: Exchange) -> None:
        if not ex.try_now():
            ex.task = asyncio.get_running_loop().create_task(ex.run())

    def exchange_done(self, ex: Exchange) -> None:
        queue = self.queue
        if queue and queue[0] is ex:
            queue.popleft()
        if ex.upgrade:
            self.close()
            return
        if not ex.keep_alive or not ex.body.complete or (self.listener.draining and not queue):
            self.close_after_write()  # (a stopping load balancer keeps no idle connection)
            return
        if queue:
            self._start(queue[0])
        else:
            self.idle_since = self.ctx.clock
        if self.full and len(queue) < self.limits.pipelined:
            self.full = self.held = False
            backlog, self.backlog = self.backlog, b""
            if backlog:
                self.data_received(backlog)
            self._sync_reading()

    def tunnel_to(self, ex: Exchange) -> None:
        self.tunnel = ex

    def closing_after(self, ex: Exchange) -> bool:
        # A stopping load balancer keeps no idle connection (exchange_done): the answer says
        # so, so that the client does not send its next request on a connection about to be
        # closed (it would get no answer; a POST is not retried by most clients).
        queue = self.queue
        return self.listener.draining and not (len(queue) > 1 and queue[0] is ex)

    def check_deadline(self, head_since: float, idle_since: float) -> None:
        """Called by the proxy's sweep: a head begun before `head_since` gets a 408, and so
        does a request whose body a body policy waits for with no byte since then; a
        connection with nothing to do since before `head_since` (no request yet) or
        `idle_since` (keep-alive between requests) is closed."""
        if self.closed or self.dead or self.tunnel is not None:
            return
        waiting = self.queue[0] if self.queue else None
        if waiting is not None and waiting.body.choose_at and waiting.body.seen < head_since:
            waiting.body_stalled()  # a body policy waited in vain for the body: a 408
            return
        if not self.reading:
            return
        if self.in_head:
            if self.head_started < head_since:
                timeout = self.limits.header_timeout
                self._refuse(
                    _Refused(
                        408,
                        "request_timeout",
                        f"a request's head must arrive within {timeout:g} s",
                        Rejection.HEADER_TIMEOUT,
                    )
                )
        elif not self.queue:
            fresh = self.building is None  # no request yet: its first head is late
            if self.idle_since < (head_since if fresh else idle_since):
                self.ctx.metrics.rejected(
                    Rejection.HEADER_TIMEOUT if fresh else Rejection.IDLE_TIMEOUT
                )
                self.close()

    def idle(self) -> bool:
        """Between two requests of a kept-alive connection (it answered one)."""
        return not (self.queue or self.in_head or self.closed or self.building is None)

    def busy(self, first_request_due: bool) -> bool:
        """A stopping load balancer waits for this connection: a request queued or in
        progress, an answer not yet flushed, a head being read, or (`first_request_due`) no
        request yet."""
        if self.queue or self.closed:  # closed: what it was sent still flushing (until
            return True  # connection_lost takes it out of the listener's clients)
        if self.dead or self.tunnel is not None:
            return False
        return self.in_head or (first_request_due and self.building is None)

    # transport helpers
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _sync_reading(self) -> None:
        read = not (self.paused or self.held or self.dead)
        if read != self.reading and self.transport is not None and not self.closed:
            self.reading = read
            if read:
                self.transport.resume_reading()
                if self.in_head:  # the head's clock runs while it can be read
                    self.head_started = self.ctx.clock
            else:
                self.transport.pause_reading()

    def pause_reading(self) -> None:
        if not self.paused:
            self.paused = True
            self._sync_reading()

    def resume_reading(self) -> None:
        if self.paused:
            self.paused = False
            self._sync_reading()

    def pause_writing(self) -> None:
        ex = self.queue[0] if self.queue else None
        if ex is not None and ex.conn is not None and ex.conn.transport is not None:
            ex.conn.transport.pause_reading()

    def resume_writing(self) -> None:
        ex = self.queue[0] if self.queue else None
        if ex is not None and ex.conn is not None and ex.conn.transport is not None:
            ex.conn.transport.resume_reading()

    def close_after_write(self) -> None:
        self.dead = True  # nothing more is parsed, not even what waits in `backlog`
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()  # flushes what was written, then closes

    def close(self) -> None:
        self.close_after_write()

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.clients.discard(self)
        if self.counted:
            self.counted = False
            left = self.listener.per_client.get(self.peer, 1) - 1
            if left > 0:
                self.listener.per_client[self.peer] = left
            else:
                self.listener.per_client.pop(self.peer, None)
        self.closed = self.dead = True
        self.backlog = b""
        pending, self.queue = list(self.queue), deque()
        for ex in pending:
            ex.client_gone()
