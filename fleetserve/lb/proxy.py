"""The data plane: a lean streaming HTTP/1.1 reverse proxy on raw asyncio protocols.

httptools (llhttp) parses both sides only to find where each message ends; the bytes of a
response pass through to the client as they arrive (SSE and token streams stay streams) and
request bodies are streamed to the replica with back-pressure both ways, never buffered whole.
Connections to replicas are pooled and kept alive. A request goes to another replica only when
it was not sent: the connection failed, or a pooled connection turned out closed before a
bodiless request got any answer. An `Upgrade` (WebSocket) becomes a raw two-way tunnel.

Why not a framework: a request through aiohttp's server and client costs about ten times what
this path costs (bench/lb), and the load balancer is the one component every request crosses.

No client can make it hold more than its limits (`Limits`, from `service.load_balancer`): a
request's head is bounded in bytes, lines and URL length while it is parsed, at most
`max_pipelined_requests` wait per connection (then the socket is not read), connections per
process are capped, and one sweep a second closes heads that take too long and idle
keep-alive connections. All of it applies before an API key is looked at.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NoReturn

import httptools

from fleetserve.lb.config import LbConfig
from fleetserve.lb.metrics import LoadTracker, Metrics, Rejection
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.lb import NO_KEY, RequestKey
from fleetserve.spec.models import LoadBalancerOptions

log = logging.getLogger("fleetserve.lb")

# RFC 9110 7.6.1: connection-specific headers are not forwarded. `upgrade` is, with
# `Connection: upgrade`, when the client asks for one.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
    }
)
# Headers a `Connection:` header may not make hop-by-hop: dropping one would change where the
# message ends for the replica (request smuggling), or leave it without a Host.
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"host"})
# A response's connection-specific headers (the replica's keep-alive is not the client's).
RESPONSE_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
_PROMPT = re.compile(rb'"(?:prompt|content|input)"\s*:\s*"((?:[^"\\]|\\.){1,4096})')
PEEK_BYTES = 16 * 1024
REPLAY_BYTES = 64 * 1024  # a body up to this size is kept until answered, to retry elsewhere
HIGH_WATER = 256 * 1024
IDLE_PER_REPLICA = 256
MIN_HEAD_BYTES = 16  # no request head is shorter ("GET / HTTP/1.0\r\n\r\n" is 18 bytes)
DEFAULT_MAX_CONNECTIONS = 10_000
# While a connection's queue is full its requests wait unparsed, up to this much; past it the
# socket is not read (reading on until then shows a client that leaves at once).
BACKLOG_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client connection may make the load balancer hold (from LoadBalancerOptions)."""

    header_bytes: int  # the header lines of one request
    header_count: int
    url_bytes: int
    pipelined: int  # requests queued on one connection
    header_timeout: float  # from a head's first byte to its end (and a new connection's first)
    idle_timeout: float  # a keep-alive connection with nothing to do
    head_bytes: int  # the most bytes a head in progress may span (request line, headers, CRLFs)
    small_read: int  # a read shorter than this cannot hold more heads than an empty queue takes

    @classmethod
    def of(cls, opts: LoadBalancerOptions) -> Limits:
        return cls(
            header_bytes=opts.max_header_bytes,
            header_count=opts.max_header_count,
            url_bytes=opts.max_url_bytes,
            pipelined=opts.max_pipelined_requests,
            header_timeout=opts.header_timeout_seconds,
            idle_timeout=opts.idle_timeout_seconds,
            head_bytes=opts.max_header_bytes + opts.max_url_bytes + 4096,
            small_read=(opts.max_pipelined_requests - 1) * MIN_HEAD_BYTES,
        )


def prompt_prefix(head: bytes, chars: int) -> str | None:
    """The first `chars` characters of the prompt in a JSON body's head (OpenAI-style
    `prompt`, the first message's `content`, or `input`), or None."""
    m = _PROMPT.search(head)
    if m is None:
        return None
    try:
        text = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        text = m.group(1).decode(errors="replace")
    return str(text)[:chars] or None


def error_response(
    status: int, code: str, message: str, close: bool = False, extra: dict[str, str] | None = None
) -> bytes:
    body = json.dumps({"error": code, "message": message}).encode() + b"\n"
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close" if close else "Connection: keep-alive",
        *(f"{k}: {v}" for k, v in (extra or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The options of every `Connection:` header, lowercased (RFC 9110 7.6.1)."""
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    )


# The first connection-specific header of a response head, or its end (group 1 empty).
_RESPONSE_HOP = re.compile(rb"\r\n(?:(connection|keep-alive|proxy-connection):|\r\n)", re.I)


def plain_response_head(data: bytes) -> bool:
    """Whether a response's first bytes hold its whole head, a final one (not 1xx), with no
    connection-specific header: such a response passes through untouched (the fast path)."""
    if data[9:10] == b"1":
        return False
    m = _RESPONSE_HOP.search(data)
    return m is not None and m.group(1) is None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    data: bytes  # the head as it goes to the client
    rechunk: bool  # the body's pieces are framed as chunks again (the parser removed them)
    keep_alive: bool  # False: the client connection closes after this response


def response_head(
    status: int,
    reason: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    http10: bool,
    keep_alive: bool,
    no_body: bool,
) -> ResponseHead:
    """A replica's response head made fit for the client: connection-specific headers (and
    those its `Connection:` names) removed; for an HTTP/1.0 client no chunked framing (the
    body is de-chunked and ends with the connection) and its own keep-alive answer."""
    drop = RESPONSE_HOP_BY_HOP | (connection_tokens(headers) - FRAMING)
    names = {name.lower() for name, _ in headers}
    chunked = b"transfer-encoding" in names
    out = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in headers:
        ln = name.lower()
        if ln in drop or (http10 and ln == b"transfer-encoding"):
            continue
        out += (name, b": ", value, b"\r\n")
    if http10:
        # Without chunked framing, a body of unknown length ends when the connection does.
        keep_alive = keep_alive and (no_body or (b"content-length" in names and not chunked))
        out.append(b"Connection: keep-alive\r\n" if keep_alive else b"Connection: close\r\n")
    out.append(b"\r\n")
    return ResponseHead(b"".join(out), chunked and not http10 and not no_body, keep_alive)


class _NotSent(Exception):
    """The request did not reach a replica: another one may take it."""


class _Refused(Exception):
    """A request the load balancer answers itself, then closes the connection."""

    def __init__(self, status: int, code: str, message: str, reason: Rejection) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.reason = reason


# -- replica side ----------------------------------------------------------------------------


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection to a replica; serves one exchange at a time."""

    def __init__(self, pool: Pool, key: str) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.got_bytes = False
        self.done = False
        self.status = 0
        self.closed = False
        self.tunnel = False
        self.keep_alive = False
        self.rewriter: ResponseRewriter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]

    def start(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.parser = httptools.HttpResponseParser(self)
        self.rewriter = None
        self.got_bytes = self.done = self.keep_alive = False
        self.status = 0

    def write(self, data: bytes) -> None:
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
        if not self.got_bytes:
            self.got_bytes = True
            # plain_response_head, inlined: this runs for every response.
            m = None if data[9:10] == b"1" else _RESPONSE_HOP.search(data)
            plain = m is not None and m.group(1) is None
            if not ex.wants_upgrade and (ex.http10 or not plain):
                # The slow path: the head is rebuilt (and the body maybe re-framed) from
                # the parser's callbacks instead of passing through.
                self.rewriter = ResponseRewriter(self, ex)
                self.parser = httptools.HttpResponseParser(self.rewriter)
        assert self.parser is not None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self.tunnel = True  # 101 Switching Protocols: raw bytes both ways from now
            if self.rewriter is not None and e.args and isinstance(e.args[0], int):
                ex.to_client(data[e.args[0] :])
        except httptools.HttpParserError as e:
            self.close()
            ex.upstream_failed(f"invalid response: {e}")
            return
        if self.rewriter is None:
            ex.to_client(data)
        ex.activity = time.monotonic()
        if self.tunnel:
            ex.upgraded()
        elif self.done:
            ex.response_complete(self.keep_alive)

    def on_headers_complete(self) -> None:
        assert self.parser is not None and self.exchange is not None
        self.status = self.parser.get_status_code()
        if self.exchange.method == b"HEAD":
            self.keep_alive = self.parser.should_keep_alive()
            self.done = True  # no body follows a response to HEAD, whatever its headers say

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 and self.status != 101:
            self.status = 0  # an interim response (100 Continue): the real one follows
            return
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside this callback
        self.done = True

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client.pause_reading()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex, self.exchange = self.exchange, None
        if ex is not None and not (self.done and not self.tunnel):
            ex.upstream_lost(self.got_bytes, self.tunnel)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ResponseRewriter:
    """The response parser's protocol on the slow path: a response whose head must change on
    its way (see `response_head`) is written to the client from the parser's callbacks. An
    HTTP/1.0 client gets no interim (1xx) response."""

    def __init__(self, conn: UpstreamConn, ex: Exchange) -> None:
        self.conn = conn
        self.ex = ex
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.rechunk = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        conn, ex = self.conn, self.ex
        conn.on_headers_complete()
        status = conn.status
        headers, reason = self.headers, self.reason
        self.headers, self.reason = [], b""
        if ex.http10 and 100 <= status < 200:
            return
        head = response_head(
            status,
            reason,
            headers,
            http10=ex.http10,
            keep_alive=ex.keep_alive,
            no_body=ex.method == b"HEAD" or status in (204, 304) or status < 200,
        )
        self.rechunk = head.rechunk
        ex.keep_alive = head.keep_alive
        ex.to_client(head.data)

    def on_body(self, data: bytes) -> None:
        self.ex.to_client(b"%x\r\n%s\r\n" % (len(data), data) if self.rechunk else data)

    def on_message_complete(self) -> None:
        if self.rechunk:
            self.ex.to_client(b"0\r\n\r\n")  # the replica's trailers are not passed on
            self.rechunk = False
        self.conn.on_message_complete()


class Pool:
    """Idle keep-alive connections per replica URL."""

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
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


# -- one request and its response --------------------------------------------------------------


class Exchange:
    """One request and its response.

    The common case runs without a task: the request is written to an idle pooled connection
    as soon as its head is parsed, and the response's end settles the exchange from the
    replica connection's callback. Anything that must wait (a new connection, a body to peek
    at, holding for a first replica, a retry) continues in a task (`run`).
    """

    def __init__(self, client: ClientConn, method: bytes, head: bytes, has_body: bool) -> None:
        self.client = client
        self.proxy = client.proxy
        self.method = method
        self.head = head  # request line and headers as they go to the replica
        self.has_body = has_body
        self.chunked = False
        self.http10 = False  # the client speaks HTTP/1.0: no chunked framing towards it
        self.wants_upgrade = False  # the client asked for a protocol upgrade (WebSocket)
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []  # buffered until a replica is attached
        self.body_size = 0
        self.body_complete = not has_body
        self.body_event: asyncio.Event | None = None  # made when a policy waits for the body
        self.conn: UpstreamConn | None = None
        self.replica: Upstream | None = None
        self.status = 0
        self.sent_to_client = False
        self.started = time.monotonic()
        self.activity = self.started
        self.keep_alive = True
        self.local: bytes | None = None  # a response the LB gives itself
        self.upgrade = False
        self.task: asyncio.Task[None] | None = None
        self.tried: set[int] = set()
        self.chosen: Upstream | None = None  # picked without a task, to connect to in one
        self.failures: list[str] = []
        self._counted: int | None = None  # the replica whose in-flight count holds this one
        self._settled = True
        self._waiter: asyncio.Future[str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reported = False
        self.replay: list[bytes] | None = []  # the body sent so far, while it is small
        self.replay_size = 0

    # client -> replica ---------------------------------------------------------------------

    def _keep_for_replay(self, data: bytes) -> None:
        if self.replay is not None:
            self.replay_size += len(data)
            if self.replay_size > REPLAY_BYTES:
                self.replay = None  # too big to keep: this request cannot be retried once sent
            else:
                self.replay.append(data)

    def _frame(self, data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def on_body(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.write(self._frame(data))
            self._keep_for_replay(data)
        else:
            self.body.append(data)
            self.body_size += len(data)
            if self.body_size >= HIGH_WATER:
                self.client.pause_reading()
            if self.body_event is not None:
                self.body_event.set()

    def on_body_complete(self) -> None:
        self.body_complete = True
        if self.body_event is not None:
            self.body_event.set()
        if self.conn is not None and self.chunked:
            self.conn.write(b"0\r\n\r\n")

    def tunnel_from_client(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.write(data)
        else:
            self.body.append(data)

    # replica -> client ---------------------------------------------------------------------

    def to_client(self, data: bytes) -> None:
        self.sent_to_client = True
        self.client.write(data)

    def response_complete(self, upstream_keep_alive: bool) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.status = conn.status
            if upstream_keep_alive and self.body_complete:
                self.proxy.pool.release(conn)
            else:
                conn.exchange = None
                conn.close()
        self._settle("ok")

    def upgraded(self) -> None:
        self.upgrade = True
        self.client.tunnel_to(self)
        if self.conn is not None:
            self.status = self.conn.status
            for data in self.body:
                self.conn.write(data)
            self.body.clear()

    def upstream_lost(self, got_bytes: bool, tunnel: bool) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not self.status:
            self.status = conn.status
        if tunnel:
            self.client.close()
            self._settle("tunnel closed")
            return
        self._settle("lost" if got_bytes else "unanswered")

    def upstream_failed(self, why: str) -> None:
        self.conn = None
        self._settle(f"failed: {why}")

    def client_gone(self) -> None:
        """The client disconnected: cancel the replica's request (close its connection)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        if self.task is not None:
            self.task.cancel()
        elif not self._settled:
            self._settled = True
            self._cancel_timer()
            self._end_attempt()
            self._report(499, str(self.replica.replica_id) if self.replica else "none")

    # bookkeeping -------------------------------------------------------------------------------

    def _begin_attempt(self, upstream: Upstream) -> None:
        rid = upstream.replica_id
        inflight = self.proxy.replicas.inflight
        inflight[rid] = inflight.get(rid, 0) + 1
        self._counted = rid
        self.tried.add(rid)
        self.proxy.load.record(str(rid))

    def _end_attempt(self) -> None:
        rid, self._counted = self._counted, None
        if rid is None:
            return
        inflight = self.proxy.replicas.inflight
        left = inflight.get(rid, 1) - 1
        if left > 0:
            inflight[rid] = left
        else:
            inflight.pop(rid, None)

    def _report(self, status: int, replica: str) -> None:
        if self._reported:
            return
        self._reported = True
        self.proxy.metrics.done(replica, status, time.monotonic() - self.started)
        self.client.exchange_done(self)

    # sending and settling ------------------------------------------------------------------------

    def _send(self, conn: UpstreamConn, upstream: Upstream) -> None:
        conn.start(self)
        self.conn, self.replica = conn, upstream
        self.status = 0
        self._settled = False
        if self.replay:
            self.body = self.replay + self.body  # a retry: the body goes again, from its start
            self.replay, self.replay_size = [], 0
        out = [self.head, *(self._frame(data) for data in self.body)]
        if self.body_complete and self.chunked:
            out.append(b"0\r\n\r\n")
        conn.write(b"".join(out))  # one send for the head and what came of the body so far
        if not self.upgrade:
            for data in self.body:
                self._keep_for_replay(data)
            self.body = []
            self.body_size = 0
            self.client.resume_reading()
        self.activity = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(
            self.proxy.opts.read_timeout_seconds, self._check_timeout
        )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        """No byte from the replica for read_timeout_seconds: give up (tunnels may idle)."""
        if self._settled:
            return
        limit = self.proxy.opts.read_timeout_seconds
        idle = time.monotonic() - self.activity
        if self.upgrade or idle < limit:
            delay = limit if self.upgrade else limit - idle
            self._timer = asyncio.get_running_loop().call_later(delay, self._check_timeout)
            return
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        self._settle("timeout")

    def _settle(self, outcome: str) -> None:
        if self._settled:
            return
        self._settled = True
        self._cancel_timer()
        if self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(outcome)
            return
        # The task-less path: conclude here.
        rid = str(self.replica.replica_id) if self.replica else "none"
        try:
            status = self._conclude(outcome)
        except _NotSent as e:
            self._end_attempt()
            self.failures.append(f"replica {rid}: {e}")
            self.task = asyncio.get_running_loop().create_task(self.run())
            return
        self._end_attempt()
        self._report(status, rid)

    def _conclude(self, outcome: str) -> int:
        """The status this attempt ends with; raises _NotSent when another replica may try."""
        proxy = self.proxy
        rid = str(self.replica.replica_id) if self.replica else "none"
        if outcome in ("ok", "tunnel closed"):
            return self.status
        if outcome == "unanswered" and not self.sent_to_client:
            # The connection closed before any response byte: the replica did not answer
            # (a stale pooled connection, or it died), so another one may, if the whole body
            # can be sent again.
            proxy.metrics.error(rid, "disconnected")
            if self.replay is not None and self.body_complete:
                raise _NotSent("closed the connection without answering")
        proxy.metrics.error(rid, "timeout" if outcome == "timeout" else "mid_response")
        if self.sent_to_client:
            self.client.close()  # a truncated response must not look complete
            return self.status or 502
        if outcome == "timeout":
            msg = error_response(
                504,
                "upstream_timeout",
                f"replica {rid} sent no response within {proxy.opts.read_timeout_seconds:g} s",
                close=not self.keep_alive,
            )
        else:
            msg = error_response(
                502,
                "upstream_disconnected",
                f"replica {rid} failed mid-request ({outcome})",
                close=not self.keep_alive,
            )
        self.client.write(msg)
        return int(msg[9:12])

    def try_now(self) -> bool:
        """Start the exchange without a task if nothing has to be waited for."""
        proxy = self.proxy
        if self.local is not None or proxy.config.policy == "prefix_affinity":
            return False
        if not proxy.replicas.upstreams:
            return False
        upstream = proxy.replicas.pick(frozenset(), self._header_key())
        if upstream is None:
            return False
        conn = proxy.pool.idle_conn(upstream)
        if conn is None:
            self.chosen = upstream  # the task connects to it: a pick is not made twice
            return False
        self._begin_attempt(upstream)
        self._send(conn, upstream)
        return True

    # the task path -------------------------------------------------------------------------------

    async def run(self) -> None:
        status, replica = 0, "none"
        try:
            status, replica = await self._run()
        except asyncio.CancelledError:
            status = 499  # the client went away
        finally:
            self._end_attempt()
            self._report(status, replica)

    async def _run(self) -> tuple[int, str]:
        proxy = self.proxy
        if self.local is not None:
            self.client.write(self.local)
            return int(self.local[9:12]), "none"
        key = await self._key()
        if not proxy.replicas.upstreams and proxy.config.hold_when_empty:
            refused = await proxy.hold()
            if refused is not None:
                self.client.write(refused)
                proxy.load.record("none")
                return int(refused[9:12]), "none"
        for _ in range(proxy.opts.max_attempts - len(self.tried)):
            upstream, self.chosen = self.chosen, None
            if upstream is None or upstream.replica_id not in proxy.replicas.upstreams:
                upstream = proxy.replicas.pick(frozenset(self.tried), key)
            if upstream is None:
                break
            rid = str(upstream.replica_id)
            self._begin_attempt(upstream)
            try:
                return await self._attempt(upstream), rid
            except _NotSent as e:
                self.failures.append(f"replica {rid}: {e}")
            finally:
                self._end_attempt()
        if not self.tried:
            proxy.load.record("none")
            msg = error_response(
                503,
                "no_ready_replicas",
                f"service {proxy.config.service!r} has no READY replica; "
                f"see `fleetserve status {proxy.config.service}`",
                close=not self.keep_alive,
            )
        else:
            msg = error_response(
                502,
                "upstream_unreachable",
                "no replica could be reached: " + "; ".join(self.failures),
                close=not self.keep_alive,
            )
        self.client.write(msg)
        return int(msg[9:12]), "none"

    def _header_key(self) -> RequestKey:
        proxy = self.proxy
        if proxy.config.policy != "sticky":
            return NO_KEY
        opts = proxy.opts
        session = None
        if opts.session_header:
            session = self.headers.get(opts.session_header.lower().encode())
        if session is None and opts.session_cookie:
            cookie = self.headers.get(b"cookie", b"")
            name = re.escape(opts.session_cookie.encode())
            m = re.search(rb"(?:^|;\s*)" + name + rb"=([^;]*)", cookie)
            session = m.group(1) if m else None
        return RequestKey(session=session.decode(errors="replace") if session else None)

    async def _key(self) -> RequestKey:
        proxy = self.proxy
        if proxy.config.policy == "prefix_affinity" and self.has_body:
            self.body_event = asyncio.Event()
            while not self.body_complete and self.body_size < PEEK_BYTES:
                self.body_event.clear()
                await self.body_event.wait()
            head = b"".join(self.body)[:PEEK_BYTES]
            return RequestKey(prefix=prompt_prefix(head, proxy.opts.prefix_chars))
        return self._header_key()

    async def _attempt(self, upstream: Upstream) -> int:
        proxy = self.proxy
        rid = str(upstream.replica_id)
        try:
            conn = await proxy.pool.acquire(upstream)
        except (OSError, TimeoutError) as e:
            proxy.replicas.discard(upstream.replica_id)  # until the controller's next push
            proxy.metrics.error(rid, "connect")
            log.warning("replica %s refused a connection: %s", rid, e or type(e).__name__)
            raise _NotSent(str(e) or type(e).__name__) from None
        if self.client.closed:
            proxy.pool.release(conn)
            raise asyncio.CancelledError
        self._waiter = asyncio.get_running_loop().create_future()
        self._send(conn, upstream)
        try:
            outcome = await self._waiter
        finally:
            self._waiter = None
        return self._conclude(outcome)


# -- client side -----------------------------------------------------------------------------


class ClientConn(asyncio.Protocol):
    """One client connection: parses its requests (within `Limits`), answers them in order."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.limits = proxy.limits
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
        self.idle_since = proxy.clock
        self.full = False  # `limits.pipelined` requests are queued: what comes waits unparsed
        self.backlog = b""  # what came while `full`, parsed once the queue drains
        self.upgrading = False
        self._refused: _Refused | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.peer = b""
        self.counted = False  # counted in proxy.per_client
        self.scheme = b"http"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        proxy = self.proxy
        if len(proxy.clients) >= proxy.max_connections:
            # Refused before it costs anything more than this answer (the kernel has already
            # accepted it): better than running out of file descriptors for everyone.
            self.dead = self.closed = True
            proxy.metrics.rejected(Rejection.CONNECTIONS)
            self.transport.write(proxy.busy)  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]
            return
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]).encode() if peer else b""
        if proxy.per_client_limit is not None:
            held = proxy.per_client.get(self.peer, 0)
            if held >= proxy.per_client_limit:  # one address must not take every connection
                self.dead = self.closed = True
                proxy.metrics.rejected(Rejection.CLIENT_CONNECTIONS)
                self.transport.write(proxy.busy_client)  # type: ignore[union-attr]
                self.transport.close()  # type: ignore[union-attr]
                return
            proxy.per_client[self.peer] = held + 1
            self.counted = True
        proxy.clients.add(self)
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
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                self._upgraded_at(e, data)
            except httptools.HttpParserError as e:
                self._parse_failed(e)
            else:
                if self.in_head and self.head_bytes > self.limits.head_bytes:
                    self._refuse(self._too_large(Rejection.HEADER_BYTES))
        if self.starting is not None:
            ex, self.starting = self.starting, None
            self._start(ex)

    def _may_fill(self, data: bytes) -> bool:
        """Whether this read may complete more heads than the queue has room for (a read that
        continues a body is parsed whole: past the room, a request gets a 429)."""
        building = self.building
        if building is not None and not building.body_complete:
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
        return True

    def _upgraded_at(self, e: httptools.HttpParserUpgrade, data: bytes) -> None:
        """The request asks for an upgrade: what follows its head is the tunnel's."""
        self.upgrading = True
        ex = self.building
        offset = e.args[0] if e.args and isinstance(e.args[0], int) else len(data)
        if ex is not None and offset < len(data):
            ex.tunnel_from_client(data[offset:])

    def _parse_failed(self, e: httptools.HttpParserError) -> None:
        refused, self._refused = self._refused, None
        if refused is None:
            # llhttp is strict: ambiguous framing (Content-Length with Transfer-Encoding,
            # two Content-Lengths, an obfuscated Transfer-Encoding, bare LF) ends here.
            refused = _Refused(
                400, "bad_request", f"malformed HTTP request: {e}", Rejection.BAD_REQUEST
            )
        ex = self.building
        if ex is not None and not ex.body_complete and ex in self.queue:
            # A broken body: its request cannot complete. Answer if nothing was, and close
            # (connection_lost cancels the replica's request).
            self.dead = True
            self.proxy.metrics.rejected(refused.reason)
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
        self.proxy.metrics.rejected(refused.reason)
        ex = Exchange(self, b"", b"", False)
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
        self.in_head = True
        self.head_started = self.proxy.clock
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
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        proxy = self.proxy
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
        upgrade = parser.should_upgrade()
        chunked = b"chunked" in lower.get(b"transfer-encoding", b"").lower()
        has_body = chunked or int(lower.get(b"content-length", b"0") or 0) > 0
        strip_auth = bool(proxy.keys)
        drop = HOP_BY_HOP
        if has_connection:
            drop = drop | (connection_tokens(headers) - FRAMING)
        out = [method, b" ", self._url, b" HTTP/1.1\r\n"]
        for name, value in headers:
            ln = name.lower()
            if ln in drop or (strip_auth and ln == b"authorization"):
                continue
            out += (name, b": ", value, b"\r\n")
        prior = lower.get(b"x-forwarded-for")
        out += (b"X-Forwarded-For: ", prior + b", " + self.peer if prior else self.peer, b"\r\n")
        out += (b"X-Forwarded-Proto: ", self.scheme, b"\r\n")
        if host is not None:
            out += (b"Host: ", host, b"\r\nX-Forwarded-Host: ", host, b"\r\n")
        else:  # HTTP/1.0 may leave it out; the replica gets HTTP/1.1, which needs one
            out += (b"Host: ", self._local_host(), b"\r\n")
        if upgrade:
            out += (b"Connection: upgrade\r\nUpgrade: ", lower.get(b"upgrade", b""), b"\r\n")
        out.append(b"\r\n")
        ex = Exchange(self, method, b"".join(out), has_body)
        ex.chunked = chunked
        ex.headers = lower
        ex.keep_alive = keep_alive
        ex.http10 = http10
        ex.wants_upgrade = upgrade
        if not proxy.authorized(lower.get(b"authorization")):
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
        if not ex.keep_alive or not ex.body_complete:
            self.close_after_write()
            return
        if queue:
            self._start(queue[0])
        else:
            self.idle_since = self.proxy.clock
        if self.full and len(queue) < self.limits.pipelined:
            self.full = self.held = False
            backlog, self.backlog = self.backlog, b""
            if backlog:
                self.data_received(backlog)
            self._sync_reading()

    def tunnel_to(self, ex: Exchange) -> None:
        self.tunnel = ex

    def check_deadline(self, head_since: float, idle_since: float) -> None:
        """Called by the proxy's sweep: a head begun before `head_since` gets a 408; a
        connection with nothing to do since before `head_since` (no request yet) or
        `idle_since` (keep-alive between requests) is closed."""
        if self.closed or self.dead or self.tunnel is not None or not self.reading:
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
                self.proxy.metrics.rejected(
                    Rejection.HEADER_TIMEOUT if fresh else Rejection.IDLE_TIMEOUT
                )
                self.close()

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
                    self.head_started = self.proxy.clock
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
        self.proxy.clients.discard(self)
        if self.counted:
            self.counted = False
            left = self.proxy.per_client.get(self.peer, 1) - 1
            if left > 0:
                self.proxy.per_client[self.peer] = left
            else:
                self.proxy.per_client.pop(self.peer, None)
        self.closed = self.dead = True
        self.backlog = b""
        pending, self.queue = list(self.queue), deque()
        for ex in pending:
            ex.client_gone()


# -- the proxy ---------------------------------------------------------------------------------


class Proxy:
    def __init__(
        self,
        config: LbConfig,
        replicas: ReplicaSet,
        metrics: Metrics | None = None,
        load: LoadTracker | None = None,
        wake: Callable[[], Coroutine[Any, Any, None]] | None = None,
        max_connections: int | None = None,
    ) -> None:
        self.config = config
        self.opts = config.options
        self.limits = Limits.of(self.opts)
        # build.connection_limit derives it from the file-descriptor limit when unset.
        self.max_connections = (
            max_connections or self.opts.max_connections or DEFAULT_MAX_CONNECTIONS
        )
        self.busy = error_response(
            503,
            "too_many_connections",
            f"this load balancer holds its {self.max_connections} connections; retry shortly",
            close=True,
            extra={"Retry-After": "1"},
        )
        self.per_client_limit = self.opts.max_connections_per_client
        self.per_client: dict[bytes, int] = {}  # open connections by client address
        self.busy_client = error_response(
            503,
            "too_many_connections_from_client",
            f"this client address holds {self.per_client_limit} connections to this load "
            "balancer; close some, or retry shortly",
            close=True,
            extra={"Retry-After": "1"},
        )
        self.replicas = replicas
        self.metrics = metrics or Metrics(config.service, config.policy)
        self.load = load or LoadTracker()
        self.wake = wake
        self.queued = 0
        self.keys = [k.encode() for k in self.opts.api_keys]
        self.pool = Pool(self.opts.connect_timeout_seconds)
        self._server: asyncio.Server | None = None
        self.clients: set[ClientConn] = set()  # open client connections (drained on close)
        self._wake_task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        # Timeouts are checked by one sweep over the connections, not a timer per request,
        # and connections stamp their times with the clock the sweep reads (no clock read
        # per request): a stamp is at most one sweep old, so a timeout is given one sweep
        # more, never less.
        shortest = min(self.limits.header_timeout, self.limits.idle_timeout)
        self.sweep_seconds = min(1.0, max(0.05, shortest / 4))
        self.clock = time.monotonic()

    def _sweep(self) -> None:
        now = self.clock = time.monotonic()
        head_since = now - self.sweep_seconds - self.limits.header_timeout
        idle_since = now - self.sweep_seconds - self.limits.idle_timeout
        for client in list(self.clients):
            client.check_deadline(head_since, idle_since)
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self.sweep_seconds, self._sweep)

    def authorized(self, header: bytes | None) -> bool:
        if not self.keys:
            return True
        scheme, _, token = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        given = token.strip()
        return any(hmac.compare_digest(given, key) for key in self.keys)

    async def hold(self) -> bytes | None:
        """No replica is ready and the service scales from zero: wait for one (bounded).
        Returns the refusal to send, or None once a replica is ready."""
        opts = self.opts
        service = self.config.service
        if self.queued >= opts.queue_size:
            return error_response(
                503,
                "queue_full",
                f"service {service!r} is starting from zero and {self.queued} requests are "
                "already waiting; retry later",
                extra={"Retry-After": "5"},
            )
        self.queued += 1
        self.metrics.set_queued(self.queued)
        try:
            if self.wake is not None:
                self._wake_task = asyncio.get_running_loop().create_task(self.wake())
            if await self.replicas.wait_ready(opts.queue_timeout_seconds):
                return None
        finally:
            self.queued -= 1
            self.metrics.set_queued(self.queued)
        return error_response(
            503,
            "no_ready_replicas",
            f"service {service!r} had no READY replica within {opts.queue_timeout_seconds:g} s",
            extra={"Retry-After": "5"},
        )

    async def serve(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> asyncio.Server:
        """Listen; with `reuse_port` several worker processes share the port (SO_REUSEPORT)
        and the kernel spreads connections over them."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ClientConn(self),
            host,
            port,
            backlog=2048,
            reuse_address=True,
            reuse_port=reuse_port or None,
            ssl=ssl_context,
            # A TLS handshake is part of reading the first head (and not yet a counted
            # connection): it gets the same time.
            ssl_handshake_timeout=self.limits.header_timeout if ssl_context else None,
        )
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.sweep_seconds, self._sweep)
        return self._server

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, drain_seconds: float = 5.0) -> None:
        """Stop listening at once; let requests in progress finish (up to `drain_seconds`),
        then close every connection. (Python 3.11's Server.wait_closed does not wait for
        connections, so the proxy tracks them itself.)"""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and any(c.queue for c in self.clients):
            await asyncio.sleep(0.05)
        for client in list(self.clients):
            client.close()
        self.pool.close()
