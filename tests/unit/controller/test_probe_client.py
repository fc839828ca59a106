"""`ProbeClient`: the prober's HTTP/1.1 client against real loopback servers (asyncio): kept-alive
connections, the listener check once per connection, answers of every framing, failures, the
concurrency bound. Behaviour only, never speed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from fleetserve.controller.probe_client import (
    ForeignListener,
    ProbeClient,
    ProbeConnectError,
    ProbeProtocolError,
    ProbeReadError,
    ProbeTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback server; yields its URL and the request heads it got."""
    heads: list[bytes] = []

    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        original = reader.readuntil

        async def readuntil(sep: bytes = b"\n") -> bytes:
            data = await original(sep)
            if sep == b"\r\n\r\n":
                heads.append(data)
            return data

        reader.readuntil = readuntil  # type: ignore[method-assign]
        await wrapped(reader, writer)

    server = await asyncio.start_server(recording, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", heads
    finally:
        server.close()


def answering(*answers: bytes, close_after: bool = False) -> Handler:
    """Answer each request on a connection with the next of `answers` (the last repeats)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(answers[min(i, len(answers) - 1)])
            await writer.drain()
            i += 1
            if close_after:
                return

    return handle


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nok\r\n3;x=1\r\nabc\r\n0\r\n\r\n"  # a chunk extension, no trailer
)
NO_CHECK: Callable[[str], str | None] = lambda _url: None  # noqa: E731


async def test_probes_reuse_one_kept_alive_connection_and_check_the_listener_once() -> None:
    checked: list[str] = []

    def check(url: str) -> str | None:
        checked.append(url)
        return None

    client = ProbeClient(check_listener=check)
    async with serve(answering(OK)) as (url, heads):
        for _ in range(3):
            assert await client.status("GET", url + "/health", {"X-Probe": "1"}, None, 5) == 200
        assert client.connects == 1 and checked == [url + "/health"]
        assert len(heads) == 3
        assert heads[0].startswith(b"GET /health HTTP/1.1\r\n") and b"X-Probe: 1\r\n" in heads[0]
        assert b"Host: 127.0.0.1:" in heads[0]
    await client.aclose()


async def test_a_connection_the_server_closed_while_idle_is_replaced_once() -> None:
    client = ProbeClient(check_listener=NO_CHECK)
    async with serve(answering(OK, close_after=True)) as (url, _heads):
        for _ in range(3):
            assert await client.status("GET", url + "/", {}, None, 5) == 200
        assert client.connects == 3  # each answer closed its connection: a new one each time
    await client.aclose()


async def test_a_foreign_listener_is_refused_before_any_request() -> None:
    client = ProbeClient(check_listener=lambda _url: "port 1 is held by another user's process")
    async with serve(answering(OK)) as (url, heads):
        with pytest.raises(ForeignListener, match="another user"):
            await client.status("GET", url + "/", {}, None, 5)
        assert heads == [] and client.connects == 0


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy", 503),
        (CHUNKED, 200),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", 204),
        (b"HTTP/1.0 200 OK\r\n\r\nbody until the connection closes", 200),
    ],
)
async def test_answers_of_every_framing_give_their_status(answer: bytes, status: int) -> None:
    client = ProbeClient(check_listener=NO_CHECK)
    close = answer.startswith(b"HTTP/1.0")
    async with serve(answering(answer, close_after=close)) as (url, _heads):
        assert await client.status("GET", url + "/", {}, None, 5) == status
        assert await client.status("GET", url + "/", {}, None, 5) == status  # next one too
    await client.aclose()


async def test_a_post_sends_its_body_with_its_length() -> None:
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        got.append(head + await reader.readexactly(7))
        writer.write(OK)
        await writer.drain()

    client = ProbeClient(check_listener=NO_CHECK)
    async with serve(handle) as (url, _heads):
        headers = {"Content-Type": "application/json"}
        assert await client.status("POST", url + "/p?q=1", headers, b'{"a":1}', 5) == 200
    assert got[0].startswith(b"POST /p?q=1 HTTP/1.1\r\n")
    assert b"Content-Length: 7\r\n" in got[0] and got[0].endswith(b'{"a":1}')
    await client.aclose()


async def test_failures_are_named() -> None:
    client = ProbeClient(check_listener=NO_CHECK)
    async with serve(answering(OK)) as (url, _heads):
        free = url  # its port is closed below
    with pytest.raises(ProbeConnectError):
        await client.status("GET", free + "/", {}, None, 5)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(10)

    async with serve(silent) as (url, _heads):
        with pytest.raises(ProbeTimeout):
            await client.status("GET", url + "/", {}, None, 0.2)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with serve(hang_up) as (url, _heads):
        with pytest.raises(ProbeReadError):
            await client.status("GET", url + "/", {}, None, 5)
    async with serve(answering(b"SSH-2.0-OpenSSH\r\n\r\n")) as (url, _heads):
        with pytest.raises(ProbeProtocolError, match="not an HTTP answer"):
            await client.status("GET", url + "/", {}, None, 5)
    with pytest.raises(ProbeProtocolError, match="cannot be sent"):
        await client.status("GET", url + "/", {"X": "a\r\nInjected: 1"}, None, 5)
    await client.aclose()


async def test_at_most_max_concurrent_probes_are_in_flight() -> None:
    inflight = [0, 0]  # now, most

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
            await asyncio.sleep(0.05)
            inflight[0] -= 1
            writer.write(OK)
            await writer.drain()

    client = ProbeClient(max_concurrent=2, check_listener=NO_CHECK)
    async with serve(slow) as (url, _heads):
        results = await asyncio.gather(
            *(client.status("GET", f"{url}/{i}", {}, None, 5) for i in range(6))
        )
    assert results == [200] * 6 and inflight[1] == 2
    await client.aclose()


async def test_idle_connections_are_bounded_and_forgotten() -> None:
    client = ProbeClient(max_idle=1, check_listener=NO_CHECK)
    async with serve(answering(OK)) as (a, _), serve(answering(OK)) as (b, _):
        await client.status("GET", a + "/", {}, None, 5)
        await client.status("GET", b + "/", {}, None, 5)  # a's idle connection is closed
        await client.status("GET", a + "/", {}, None, 5)
        assert client.connects == 3
        client.forget(a)
        await client.status("GET", a + "/", {}, None, 5)
        assert client.connects == 4
    await client.aclose()


async def test_a_path_with_a_space_or_past_ascii_is_sent_percent_encoded() -> None:
    """Such a readiness path passes validation (SkyServe's client encodes it): it is sent
    encoded, not as a request line every replica refuses (400) or the probe cannot write."""
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(OK)
        await writer.drain()

    client = ProbeClient(check_listener=NO_CHECK)
    async with serve(handle) as (url, _heads):
        assert await client.status("GET", url + "/health x", {}, None, 5) == 200
        assert await client.status("GET", url + "/h\u20ac?a=%20b", {}, None, 5) == 200
    assert got[0].startswith(b"GET /health%20x HTTP/1.1\r\n")
    assert got[1].startswith(b"GET /h%E2%82%AC?a=%20b HTTP/1.1\r\n")
    await client.aclose()
