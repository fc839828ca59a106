"""The readiness probes' HTTP client: small requests over kept-alive connections, many at once.

A controller with a thousand replicas sends about two hundred probes a second. Through httpx
each cost about a millisecond of the controller's only core (a request object, auth and
redirect hooks, a pool that scans every connection for each request) plus a read of
/proc/net/tcp to check who listens on the replica's port: together most of an idle
controller's CPU (docs/scaling.md). Here a probe is one write and one read on a connection
kept alive per endpoint, and the listener check is made when a connection is opened, not for
every probe: a kept-alive connection stays with the process that accepted it, so a port
taken over by another user's process is only ever reached through a new connection, which is
checked first.

`ProbeTransport` is what the prober needs; `ProbeClient` is the controller's, `HttpxProbes`
sends the probes through an httpx client instead (any transport httpx takes, e.g. a mock).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import resource
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import quote, urlsplit

import httpx

from fleetserve.core.sockets import listener_uids

MAX_HEAD_BYTES = 64 * 1024  # status line and headers of an answer
MAX_BODY_BYTES = 1024 * 1024  # read (and the connection kept) up to this; past it: closed
MAX_CONCURRENT = 64  # probes in flight at once; the others wait, their timeout not started


class ProbeError(Exception):
    """A probe that got no HTTP status. `label` names the failure as httpx would."""

    label = "ProbeError"


class ProbeConnectError(ProbeError):
    label = "ConnectError"


class ProbeTimeout(ProbeError):
    label = "Timeout"


class ProbeReadError(ProbeError):
    """The connection closed (or reset) before a whole answer."""

    label = "ReadError"


class ProbeProtocolError(ProbeError):
    label = "RemoteProtocolError"


class ForeignListener(ProbeError):
    """The endpoint's loopback port is held by another user's process: not the replica."""

    label = "ForeignListener"


class ProbeTransport(Protocol):
    async def status(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_seconds: float,
    ) -> int:
        """Send one request; the answer's HTTP status. Raises `ProbeError` (a subclass) when
        no status came: ForeignListener, ProbeConnectError, ProbeTimeout, ..."""
        ...

    async def aclose(self) -> None: ...


def foreign_listener(endpoint: str) -> str | None:
    """Why a loopback endpoint's port is not the replica's: held by another user's process
    (read from /proc/net/tcp now)."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    if parts.port is None or not (host.startswith("127.") or host in ("localhost", "::1")):
        return None
    uids = listener_uids(parts.port)
    others = uids - {os.getuid()}
    if others:
        who = ", ".join(str(u) for u in sorted(others))
        return f"port {parts.port} is held by another user's process (uid {who}), not the replica"
    return None


def default_max_idle() -> int:
    """Idle connections kept: one per replica, within what the open-file limit leaves."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, (soft - 1024) // 2))


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Stale(Exception):
    """A reused connection was closed by the server while idle: try once on a new one."""


def _request_bytes(
    method: str, path: str, host: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    # A space or a character past ASCII cannot stand in a request line: percent-encoded, as
    # SkyServe's HTTP client sends such a path (what is encoded already stays so).
    path = quote(path, safe="/?#[]@!$&'()*+,;=:%~-._")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    given = {k.lower() for k in headers}
    if "user-agent" not in given:
        lines.append("User-Agent: fleetserve-probe")
    if "accept" not in given:
        lines.append("Accept: */*")
    for key, value in headers.items():
        if any(c in key + value for c in "\r\n\0") or not key or ":" in key:
            raise ProbeProtocolError(f"header {key!r} cannot be sent")
        lines.append(f"{key}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="strict")
    return head + (body or b"")


_RequestKey = tuple[str, str, tuple[tuple[str, str], ...], bytes | None]
MAX_PREPARED = 8192  # requests kept as bytes (one per replica); past it the cache starts anew


def _prepare(
    method: str, url: str, headers: Mapping[str, str], body: bytes | None
) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) of a probe of `url`."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ProbeProtocolError(f"cannot probe {url!r}: only http:// endpoints")
    host, port = parts.hostname, parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    shown = f"[{host}]" if ":" in host else host
    where = shown if parts.port is None else f"{shown}:{port}"
    return host, port, _request_bytes(method, path, where, headers, body)


class ProbeClient:
    """HTTP/1.1 over asyncio streams: at most `max_concurrent` probes at once, one idle
    connection kept per endpoint (the `max_idle` most recently used)."""

    def __init__(
        self,
        max_concurrent: int = MAX_CONCURRENT,
        max_idle: int | None = None,
        check_listener: Callable[[str], str | None] = foreign_listener,
    ) -> None:
        self.max_idle = default_max_idle() if max_idle is None else max_idle
        self.check_listener = check_listener
        self._slots = asyncio.Semaphore(max_concurrent)
        self._idle: collections.OrderedDict[tuple[str, int], _Conn] = collections.OrderedDict()
        self.connects = 0  # new connections opened (each one checked for a foreign listener)
        # Each replica's probe is the same request every time: made into bytes once.
        self._prepared: dict[_RequestKey, tuple[str, int, bytes]] = {}

    async def status(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_seconds: float,
    ) -> int:
        key = (method, url, tuple(headers.items()), body)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = _prepare(method, url, headers, body)
            if len(self._prepared) >= MAX_PREPARED:
                self._prepared.clear()
            self._prepared[key] = prepared
        host, port, request = prepared
        async with self._slots:
            try:
                async with asyncio.timeout(timeout_seconds):
                    return await self._send(url, host, port, request, method == "HEAD")
            except TimeoutError:
                raise ProbeTimeout(f"no answer within {timeout_seconds:g} s") from None

    async def get(
        self,
        url: str,
        headers: Mapping[str, str],
        timeout_seconds: float,
        max_bytes: int = MAX_BODY_BYTES,
    ) -> tuple[int, bytes, bool]:
        """GET `url`: its status, its body (the first `max_bytes`), and whether the body was
        cut there. The whole exchange, the body's last byte included, ends within
        `timeout_seconds`: a server that sends its answer a byte at a time, or without end,
        holds it no longer (ProbeTimeout). The same connections and slots as the probes."""
        host, port, request = _prepare("GET", url, headers, None)
        sink = _Sink(max_bytes)
        async with self._slots:
            try:
                async with asyncio.timeout(timeout_seconds):
                    status = await self._send(url, host, port, request, False, sink)
            except TimeoutError:
                raise ProbeTimeout(f"no whole answer within {timeout_seconds:g} s") from None
        return status, bytes(sink.data), sink.cut

    async def _send(
        self,
        url: str,
        host: str,
        port: int,
        request: bytes,
        head_only: bool,
        sink: _Sink | None = None,
    ) -> int:
        key = (host, port)
        conn = self._idle.pop(key, None)
        if conn is not None:
            try:
                return await self._exchange(key, conn, request, head_only, reused=True, sink=sink)
            except _Stale:
                pass  # closed while idle: the request was not read, send it on a new one
        reason = self.check_listener(url)
        if reason is not None:
            raise ForeignListener(reason)
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)
        except OSError as e:
            raise ProbeConnectError(str(e) or type(e).__name__) from None
        self.connects += 1
        try:
            return await self._exchange(key, _Conn(reader, writer), request, head_only, sink=sink)
        except _Stale:
            raise ProbeReadError("") from None

    async def _exchange(
        self,
        key: tuple[str, int],
        conn: _Conn,
        request: bytes,
        head_only: bool,
        reused: bool = False,
        sink: _Sink | None = None,
    ) -> int:
        keep = False
        try:
            conn.writer.write(request)
            try:
                await conn.writer.drain()
                status, keep = await self._read_answer(conn.reader, head_only, sink)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                partial = isinstance(e, asyncio.IncompleteReadError) and bool(e.partial)
                if not partial:
                    raise _Stale() from None  # nothing of an answer came back
                raise ProbeReadError("the connection closed in the middle of the answer") from e
            except asyncio.LimitOverrunError:
                raise ProbeProtocolError("the answer's headers are too long") from None
        finally:
            if keep:
                self._keep(key, conn)
            else:
                conn.close()
        return status

    async def _read_answer(
        self, reader: asyncio.StreamReader, head_only: bool, sink: _Sink | None = None
    ) -> tuple[int, bool]:
        """The status of the answer, and whether the connection may carry another request;
        the body goes to `sink` when one is given (up to its limit: past it, closed)."""
        for _ in range(5):  # a few informational (1xx) answers may come first
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, _, rest = head.partition(b"\r\n")
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                raise ProbeProtocolError(f"not an HTTP answer: {status_line[:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue
            fields: dict[bytes, bytes] = {}
            for line in rest.split(b"\r\n"):
                name, sep, value = line.partition(b":")
                if sep:
                    fields[name.strip().lower()] = value.strip().lower()
            keep = parts[0] == b"HTTP/1.1" and fields.get(b"connection") != b"close"
            if head_only or status in (204, 304):
                return status, keep
            if b"chunked" in fields.get(b"transfer-encoding", b""):
                return status, keep and await self._skip_chunked(reader, sink)
            length = fields.get(b"content-length")
            if length is not None:
                if not length.isdigit():
                    raise ProbeProtocolError("a malformed Content-Length")
                n = int(length)
                if sink is not None:
                    whole = n <= sink.limit
                    sink.add(await reader.readexactly(min(n, sink.limit)))
                    sink.cut = not whole
                    return status, keep and whole
                if n > MAX_BODY_BYTES:
                    return status, False  # not read: the connection is closed instead
                await reader.readexactly(n)
                return status, keep
            await _read_to_end(reader, sink)  # no length: the body ends with the connection
            return status, False
        raise ProbeProtocolError("too many informational (1xx) answers")

    async def _skip_chunked(self, reader: asyncio.StreamReader, sink: _Sink | None = None) -> bool:
        """Read a chunked body to its end; False when it is too long to read (closed)."""
        total = 0
        limit = MAX_BODY_BYTES if sink is None else sink.limit
        while True:
            line = await reader.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProbeProtocolError("a malformed chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return True
            total += size
            if total > limit:
                if sink is not None:
                    sink.add(await reader.readexactly(size - (total - limit)))
                    sink.cut = True
                return False
            chunk = await reader.readexactly(size + 2)
            if sink is not None:
                sink.add(chunk[:-2])

    def _keep(self, key: tuple[str, int], conn: _Conn) -> None:
        old = self._idle.pop(key, None)
        if old is not None:
            old.close()
        self._idle[key] = conn
        while len(self._idle) > self.max_idle:
            _key, oldest = self._idle.popitem(last=False)
            oldest.close()

    def forget(self, endpoint: str) -> None:
        """Close the idle connection to an endpoint (its replica is gone)."""
        parts = urlsplit(endpoint)
        if parts.hostname:
            conn = self._idle.pop((parts.hostname, parts.port or 80), None)
            if conn is not None:
                conn.close()

    async def aclose(self) -> None:
        while self._idle:
            _key, conn = self._idle.popitem()
            conn.close()


class _Sink:
    """A body read by `ProbeClient.get`, up to `limit` bytes."""

    __slots__ = ("cut", "data", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.cut = False

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.cut = True
        self.data += chunk[:room]


async def _read_to_end(reader: asyncio.StreamReader, sink: _Sink | None = None) -> None:
    total = 0
    limit = MAX_BODY_BYTES if sink is None else sink.limit
    while chunk := await reader.read(65536):
        total += len(chunk)
        if sink is not None:
            sink.add(chunk)
        if total > limit:
            return


class HttpxProbes:
    """Probes through an httpx client (its transport: a mock in tests, a proxy, ...), with
    the listener check made for every probe."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        check_listener: Callable[[str], str | None] = foreign_listener,
    ) -> None:
        self.client = client
        self.check_listener = check_listener

    async def status(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_seconds: float,
    ) -> int:
        reason = self.check_listener(url)
        if reason is not None:
            raise ForeignListener(reason)
        try:
            resp = await self.client.request(
                method, url, content=body, headers=dict(headers), timeout=timeout_seconds
            )
        except httpx.TimeoutException:
            raise ProbeTimeout(f"no answer within {timeout_seconds:g} s") from None
        except httpx.ConnectError as e:
            raise ProbeConnectError(str(e)) from None
        except (httpx.ReadError, httpx.RemoteProtocolError) as e:
            error = ProbeReadError if isinstance(e, httpx.ReadError) else ProbeProtocolError
            raise error(str(e)) from None
        return resp.status_code

    async def get(
        self,
        url: str,
        headers: Mapping[str, str],
        timeout_seconds: float,
        max_bytes: int = MAX_BODY_BYTES,
    ) -> tuple[int, bytes, bool]:
        """`ProbeClient.get` through the httpx client."""
        reason = self.check_listener(url)
        if reason is not None:
            raise ForeignListener(reason)
        body = bytearray()
        cut = False
        try:
            async with asyncio.timeout(timeout_seconds):
                async with self.client.stream("GET", url, headers=dict(headers)) as resp:
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            del body[max_bytes:]
                            cut = True
                            break
        except (TimeoutError, httpx.TimeoutException):
            raise ProbeTimeout(f"no whole answer within {timeout_seconds:g} s") from None
        except httpx.ConnectError as e:
            raise ProbeConnectError(str(e)) from None
        except httpx.HTTPError as e:
            raise ProbeReadError(str(e)) from None
        return resp.status_code, bytes(body), cut

    async def aclose(self) -> None:
        return None  # the client is its owner's
