"""The replica side of the proxy: keep-alive connections to replicas (a pool of idle ones
per replica) and the rewriting of a response head on its way to the client."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import Callable

import httptools

from fleetserve.lb.context import ExchangeSide
from fleetserve.lb.http import HIGH_WATER, RESPONSE_HOP_PATTERN, response_head
from fleetserve.lb.replica_set import Upstream

IDLE_PER_REPLICA = 256


class _Ends:
    """Counts the responses a parser completes (for `_first_response_end`)."""

    def __init__(self) -> None:
        self.complete = 0
        self.status = 0
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_message_complete(self) -> None:
        if not 100 <= self.status < 200:  # (an interim answer: the real one follows)
            self.complete += 1


def _first_response_end(data: bytes, head_request: bool) -> int | None:
    """Where the first whole response in `data` ends (it starts at data's first byte), found
    by parsing ever longer prefixes (only for a replica that sent more than its response:
    never on the common path); None when no prefix holds a whole one."""

    def complete(k: int) -> bool:
        ends = _Ends()
        if head_request:
            return _head_end(data[:k]) is not None
        with contextlib.suppress(httptools.HttpParserError):
            ends.parser.feed_data(data[:k])
        return ends.complete > 0

    if not complete(len(data)):
        return None
    lo, hi = 0, len(data)  # complete(hi), not complete(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if complete(mid) else (mid, hi)
    return hi


def _head_end(data: bytes) -> int | None:
    end = data.find(b"\r\n\r\n")
    return None if end < 0 else end + 4


_FRAMING = re.compile(rb"\r\n(content-length|transfer-encoding)[ \t]*:([^\r\n]*)", re.I)
MAX_HEAD_KEPT = 64 * 1024  # of an answer's head kept to tell how its body ends


def _framed(head: bytes) -> bool:
    """Whether a response head says where its body ends (RFC 9112 6.3): a Transfer-Encoding
    whose last coding is chunked, or, without a Transfer-Encoding, a Content-Length. Else the
    body runs until the connection closes."""
    codings = b""
    length = False
    for name, value in _FRAMING.findall(head):
        if name.lower() == b"transfer-encoding":
            codings += b"," + value
        else:
            length = True
    if codings:
        return codings.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
    return length


def _body_in(data: bytes) -> bool:
    """Whether this first piece of an answer holds body bytes after its head (read only for a
    request whose head is held: move_waiting_requests)."""
    end = data.find(b"\r\n\r\n")
    return end >= 0 and end + 4 < len(data)


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection to a replica; serves one exchange at a time."""

    def __init__(self, pool: Pool, key: str) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: ExchangeSide | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.got_bytes = False
        self.done = False
        self.status = 0
        self.closed = False
        self.tunnel = False
        self.keep_alive = False
        # The replica sent bytes past the end of its response (a second response, a
        # Content-Length too short): they never reach the client, the connection is not
        # used again.
        self.extra = False
        self.rewriter: ResponseRewriter | None = None
        self.first = b""  # the answer's first read (its head, to tell how its body ends)
        self.interim = False  # an interim (1xx) answer came first: `first` holds its head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]

    def start(self, exchange: ExchangeSide) -> None:
        self.exchange = exchange
        self.parser = httptools.HttpResponseParser(self)
        self.rewriter = None
        self.got_bytes = self.done = self.keep_alive = self.extra = False
        self.status = 0
        self.first = b""
        self.interim = False

    def write(self, data: bytes | bytearray) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:
            self.close()  # a replica should not talk unasked
            return
        if self.tunnel:
            ex.to_client(data)
            return
        head_seen = self.status != 0  # the head came in an earlier piece: this one is body
        if self.got_bytes and not head_seen and len(self.first) < MAX_HEAD_KEPT:
            self.first += data  # (a head in several reads: the parser has not ended it yet)
        out = data
        if not self.got_bytes:
            self.got_bytes = True
            self.first = data
            # plain_response_head, inlined: this runs for every response.
            m = None if data[9:10] == b"1" else RESPONSE_HOP_PATTERN.search(data)
            plain = m is not None and m.group(1) is None
            if m is not None and plain and not ex.wants_upgrade and not ex.http10:
                if not ex.keep_alive or ex.closes_client():
                    # The connection closes after this answer (the client asked, or the load
                    # balancer stops): the head says so, the rest still passes through.
                    at = m.start() + 2
                    out = b"%sConnection: close\r\n%s" % (data[:at], data[at:])
                    ex.keep_alive = False
            elif not ex.wants_upgrade and (ex.http10 or not plain):
                # The slow path: the head is rebuilt (and the body maybe re-framed) from
                # the parser's callbacks instead of passing through.
                self.rewriter = ResponseRewriter(self, ex)
                self.parser = httptools.HttpResponseParser(self.rewriter)
        assert self.parser is not None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            if not ex.wants_upgrade:
                # A 101 to a request that asked for no upgrade would turn the client's
                # connection into a raw tunnel to the replica.
                self.close()
                ex.upstream_failed("invalid response: 101 to a request that asked no upgrade")
                return
            self.tunnel = True  # 101 Switching Protocols: raw bytes both ways from now
            if self.rewriter is not None and e.args and isinstance(e.args[0], int):
                ex.to_client(data[e.args[0] :])
        except httptools.HttpParserError as e:
            if not self.done:
                self.close()
                ex.upstream_failed(f"invalid response: {e}")
                return
            self.extra = True  # (what follows a whole response is not one)
        if self.extra:
            end = self._response_end(data, head_seen)
            if end is None:
                self.close()
                ex.upstream_failed("invalid response: bytes past its end, in a long answer")
                return
            out = out[: end + len(out) - len(data)]  # (a `Connection: close` added to its head)
            self.keep_alive = False
        if self.done and (ex.method == b"HEAD" or self.status in (204, 304)):
            # A response without a body: what a replica sends after its head (a HEAD answered
            # as a GET, a 204 with a body) never reaches the client, and the connection is not
            # used again (those bytes would come as the answer to the next request on it).
            if ex.method == b"HEAD" and not head_seen and self.rewriter is None:
                end = _head_end(data)
                if end is not None:
                    out = out[: end + len(out) - len(data)]
            self.keep_alive = False
        if ex.first_byte is None and (
            head_seen or self.done or self.tunnel or (ex.held_head is not None and _body_in(data))
        ):
            # The answer's first body byte (or its end, or its upgrade): a streaming LLM
            # server sends its head at once and its first token later, so the head alone
            # does not count. A retry only follows an attempt that got no byte at all, so
            # this is the answered attempt's.
            ex.first_byte = self.pool.monotonic() - ex.sent_at
            ex.prefilled()
        if self.rewriter is None:
            ex.to_client(out)
        ex.activity = self.pool.monotonic()
        if self.tunnel:
            ex.upgraded()
        elif self.done:
            ex.response_complete(self.keep_alive)

    def _response_end(self, data: bytes, head_seen: bool) -> int | None:
        """Where the response ends in this read, when the replica sent more (None: the
        response began in an earlier read, so where it ends here is not known). The slow
        path wrote only the response already (its callbacks ignore the rest)."""
        if self.rewriter is not None:
            return 0
        if head_seen:
            return None
        assert self.exchange is not None
        return _first_response_end(data, self.exchange.method == b"HEAD")

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True  # a second response, unasked for

    def on_headers_complete(self) -> None:
        assert self.parser is not None and self.exchange is not None
        if self.extra:
            return
        self.status = self.parser.get_status_code()
        if self.exchange.method == b"HEAD":
            self.keep_alive = self.parser.should_keep_alive()
            self.done = True  # no body follows a response to HEAD, whatever its headers say

    def on_message_complete(self) -> None:
        if self.extra:
            return
        if 100 <= self.status < 200 and self.status != 101:
            self.status = 0  # an interim response (100 Continue): the real one follows
            self.interim = True
            return
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside this callback
        self.done = True

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_client()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.resume_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex, self.exchange = self.exchange, None
        if ex is None or (self.done and not self.tunnel):
            return
        if exc is None and not self.tunnel and self._ends_with_close(ex):
            # A response framed by neither Content-Length nor chunked ends when its
            # connection does (RFC 9112 6.3; HTTP/1.0 servers): whole, not cut short. Its
            # client learns the end the same way.
            ex.keep_alive = False
            if ex.first_byte is None:
                ex.first_byte = self.pool.monotonic() - ex.sent_at
                ex.prefilled()
            ex.response_complete(False)
            return
        ex.upstream_lost(self.got_bytes, self.tunnel)

    def _ends_with_close(self, ex: ExchangeSide) -> bool:
        """Whether the answer begun here is one whose body runs until the connection closes:
        a final status with a body, a head (in the first read) with no framing header."""
        if self.status < 200 or self.status in (204, 304) or self.extra or ex.method == b"HEAD":
            return False
        if self.interim:
            return False  # (the final head came after `first`: not read here, so not trusted)
        first = self.first.lstrip(b"\r\n")  # (blank lines before a status line are skipped)
        end = _head_end(first)
        return end is not None and not _framed(first[:end])

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ResponseRewriter:
    """The response parser's protocol on the slow path: a response whose head must change on
    its way (see `response_head`) is written to the client from the parser's callbacks. An
    HTTP/1.0 client gets no interim (1xx) response."""

    def __init__(self, conn: UpstreamConn, ex: ExchangeSide) -> None:
        self.conn = conn
        self.ex = ex
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.rechunk = False

    def on_message_begin(self) -> None:
        self.conn.on_message_begin()

    def on_status(self, reason: bytes) -> None:
        if self.conn.extra:
            return
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.conn.extra:
            return
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        conn, ex = self.conn, self.ex
        if conn.extra:
            return
        conn.on_headers_complete()
        status = conn.status
        headers, reason = self.headers, self.reason
        self.headers, self.reason = [], b""
        if (ex.http10 and 100 <= status < 200) or (status == 101 and not ex.wants_upgrade):
            return  # (a 101 nobody asked for is refused once parsed: data_received)
        head = response_head(
            status,
            reason,
            headers,
            http10=ex.http10,
            keep_alive=ex.keep_alive and not ex.closes_client(),
            no_body=ex.method == b"HEAD" or status in (204, 304) or status < 200,
        )
        self.rechunk = head.rechunk
        if status >= 200:  # (an interim answer says nothing of the connection's end)
            ex.keep_alive = head.keep_alive
        ex.to_client(head.data)

    def on_body(self, data: bytes) -> None:
        if self.conn.extra or self.ex.method == b"HEAD":
            return
        self.ex.to_client(b"%x\r\n%s\r\n" % (len(data), data) if self.rechunk else data)

    def on_message_complete(self) -> None:
        if self.conn.extra:
            return
        if self.rechunk:
            self.ex.to_client(b"0\r\n\r\n")  # the replica's trailers are not passed on
            self.rechunk = False
        self.conn.on_message_complete()


class Pool:
    """Idle keep-alive connections per replica URL."""

    def __init__(
        self, connect_timeout: float, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.connect_timeout = connect_timeout
        self.monotonic = monotonic  # the load balancer's clock (fleetserve.core.clock)
        self.idle: dict[str, deque[UpstreamConn]] = {}

    def idle_conn(self, upstream: Upstream) -> UpstreamConn | None:
        idle = self.idle.get(upstream.url)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def acquire(self, upstream: Upstream) -> UpstreamConn:
        conn = self.idle_conn(upstream)
        if conn is not None:
            return conn
        host, _, port = upstream.url.removeprefix("http://").partition(":")
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                lambda: UpstreamConn(self, upstream.url), host, int(port.rstrip("/") or 80)
            )
        return conn

    def release(self, conn: UpstreamConn) -> None:
        conn.exchange = None
        conn.first = b""  # (an idle connection holds no answer's bytes)
        idle = self.idle.setdefault(conn.key, deque())
        if conn.closed or len(idle) >= IDLE_PER_REPLICA:
            conn.close()
            return
        idle.append(conn)

    def close(self) -> None:
        for idle in self.idle.values():
            for conn in idle:
                conn.close()
        self.idle.clear()
