"""Raw HTTP on loopback for the abuse tests: a client that sends exact bytes and reads until
the load balancer closes, a replica that records what reaches it, a well-behaved client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httptools


@dataclass
class Reply:
    """What a client got back: the raw bytes and whether the connection was closed."""

    data: bytes
    closed: bool
    seconds: float

    @property
    def statuses(self) -> list[int]:
        return [r.status for r in parse_responses(self.data)]


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n.lower() == name.lower()), None)


class _ResponseCollector:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Response] = []
        self.current: Response | None = None

    def on_message_begin(self) -> None:
        self.current = Response(0, [])

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.done.append(self.current)
        self.current = None


def parse_responses(data: bytes) -> list[Response]:
    """Every response in a byte stream (de-chunked), the last one even when it ends with the
    connection; 1xx responses left out."""
    collector = _ResponseCollector()
    with contextlib.suppress(httptools.HttpParserError):
        collector.parser.feed_data(data)
    found = collector.done
    if collector.current is not None and collector.current.status:
        found = [*found, collector.current]
    return [r for r in found if not 100 <= r.status < 200]


async def converse(
    port: int,
    pieces: bytes | list[bytes],
    *,
    pause: float = 0.0,
    read_for: float = 5.0,
    send_for: float | None = None,
) -> Reply:
    """Send `pieces` (`pause` seconds apart) and read until the connection closes or
    `read_for` seconds pass. Sending stops at a reset or after `send_for` seconds; what the load
    balancer answered before resetting is still read."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    t0 = time.monotonic()

    async def send() -> None:
        async with asyncio.timeout(send_for):
            for piece in [pieces] if isinstance(pieces, bytes) else pieces:
                await loop.sock_sendall(sock, piece)
                if pause:
                    await asyncio.sleep(pause)

    sender = asyncio.create_task(send())
    got = bytearray()
    closed = False
    try:
        async with asyncio.timeout(read_for):
            while True:
                chunk = await loop.sock_recv(sock, 1 << 16)
                if not chunk:
                    closed = True
                    break
                got += chunk
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        sock.close()
    return Reply(bytes(got), closed, time.monotonic() - t0)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


CHUNKED = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
HOP = b"Connection: X-Hop, keep-alive\r\nKeep-Alive: timeout=5\r\nX-Hop: secret\r\nX-Kept: yes\r\n"


@dataclass
class Replica:
    """A replica on a raw asyncio protocol that records every request it gets whole.
    /chunked: a chunked body; /hop and /hop-chunked: connection-specific headers too;
    /wait: answers after `wait_seconds`; anything else: JSON naming the path and body size."""

    wait_seconds: float = 0.2
    seen: list[Seen] = field(default_factory=list)
    open_connections: int = 0
    server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Replica:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _ReplicaConn(self), "127.0.0.1", 0)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    def reply(self, seen: Seen) -> bytes:
        if seen.path == "/chunked":
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED
        if seen.path == "/hop-chunked":
            return b"HTTP/1.1 200 OK\r\n" + HOP + b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED
        if seen.path == "/hop":
            return b"HTTP/1.1 200 OK\r\n" + HOP + b"Content-Length: 2\r\n\r\nok"
        body = json.dumps(
            {"path": seen.path, "bytes": len(seen.body), "host": seen.headers.get("host")}
        ).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class _ReplicaConn(asyncio.Protocol):
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.replica.open_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.replica.open_connections -= 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode(errors="replace")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        seen = Seen(method, self.url.decode(), self.headers, bytes(self.body))
        self.replica.seen.append(seen)
        answer = self.replica.reply(seen)
        if seen.path.startswith("/wait"):
            asyncio.get_running_loop().call_later(self.replica.wait_seconds, self._write, answer)
        else:
            self._write(answer)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


@dataclass
class GoodClient:
    """A well-behaved client on one keep-alive connection: a GET every `every` seconds."""

    url: str
    every: float = 0.02
    statuses: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
            while not stop.is_set():
                try:
                    async with s.get(f"{self.url}/good") as r:
                        await r.read()
                        self.statuses.append(r.status)
                except (aiohttp.ClientError, TimeoutError) as e:
                    self.errors.append(repr(e))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.every)

    def check(self, at_least: int = 3) -> None:
        assert not self.errors, self.errors
        assert len(self.statuses) >= at_least, self.statuses
        assert set(self.statuses) == {200}, self.statuses


@contextlib.asynccontextmanager
async def good_client(url: str, every: float = 0.02) -> AsyncIterator[GoodClient]:
    """A GoodClient running for the block; afterwards it must have had only 200s."""
    client = GoodClient(url, every)
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    await asyncio.sleep(3 * every)
    try:
        yield client
    finally:
        stop.set()
        await task
    client.check()


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run `coro` (a sampling loop) as a task for the block; cancelled however it ends."""
    task = asyncio.create_task(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
