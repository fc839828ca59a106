"""The API's connection admission (fleetserve.api.connections) on a real uvicorn server and
real sockets, clients told apart by their source address (127.0.0.x): the total bound
pushes out the oldest idle connection of the client holding the most, a token holder's
connection leaves the anonymous count, and a connection in the middle of a request is never
pushed out."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from fleetserve.api.connections import Admission, protocol_class, token_check

TOKEN = "t" * 43


async def _app(scope: dict[str, object], receive: object, send: object) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(1)
    body = b"ok"
    await send(  # type: ignore[operator]
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})  # type: ignore[operator]


@pytest.fixture
async def server() -> AsyncIterator[tuple[int, Admission]]:
    """max 16 connections: 12 anonymous at most, 8 per client."""
    admission = Admission(
        token_check(TOKEN), header_seconds=30, max_connections=16, max_per_client=8
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(
        _app,  # type: ignore[arg-type]
        http=protocol_class(admission),
        ws="none",
        lifespan="off",
        log_level="warning",
        limit_concurrency=16,
    )
    srv = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield int(sock.getsockname()[1]), admission
    srv.should_exit = True
    await asyncio.wait_for(task, 10)


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _connect(port: int, source: str) -> Conn:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _closed(conn: Conn, seconds: float = 2.0) -> bool:
    """Whether the server closed the connection (within `seconds`)."""
    try:
        return await asyncio.wait_for(conn[0].read(65536), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def _get(conn: Conn, path: str = "/", token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    conn[1].write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    return await asyncio.wait_for(conn[0].read(65536), 10)


async def _settle(admission: Admission, anonymous: int) -> None:
    for _ in range(200):
        if admission.anonymous == anonymous:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{admission.anonymous} anonymous connections, not {anonymous}")


async def test_the_total_bound_pushes_out_the_heaviest_clients_oldest(
    server: tuple[int, Admission],
) -> None:
    port, admission = server
    a = [await _connect(port, "127.0.0.2") for _ in range(8)]
    await _settle(admission, 8)
    b = [await _connect(port, "127.0.0.3") for _ in range(4)]
    await _settle(admission, 12)  # the bound: 3/4 of 16
    newcomer = await _connect(port, "127.0.0.4")
    assert (await _get(newcomer)).startswith(b"HTTP/1.1 200")
    # Room was made by a's oldest (a holds the most), not by b's, nor the newcomer's.
    assert await _closed(a[0])
    assert not any(await asyncio.gather(*(_closed(c, 0.2) for c in a[1:] + b)))
    assert admission.counts.get("pushed_out") == 1


async def test_the_per_client_bound_pushes_out_that_clients_oldest_only(
    server: tuple[int, Admission],
) -> None:
    port, admission = server
    other = await _connect(port, "127.0.0.3")
    a = [await _connect(port, "127.0.0.2") for _ in range(8)]
    await _settle(admission, 9)
    ninth = await _connect(port, "127.0.0.2")
    assert (await _get(ninth)).startswith(b"HTTP/1.1 200")
    assert await _closed(a[0])
    assert not await _closed(other, 0.2)


async def test_a_token_holder_leaves_the_count_and_a_busy_connection_stays(
    server: tuple[int, Admission],
) -> None:
    port, admission = server
    trusted = await _connect(port, "127.0.0.2")
    assert (await _get(trusted, token=TOKEN)).startswith(b"HTTP/1.1 200")
    await _settle(admission, 0)  # no longer anonymous: never pushed out, never counted
    wrong = await _connect(port, "127.0.0.2")
    assert (await _get(wrong, token="nope")).startswith(b"HTTP/1.1 200")  # (the app's call)
    await _settle(admission, 1)  # a wrong token is no token
    busy = await _connect(port, "127.0.0.2")
    busy[1].write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle(admission, 2)
    await asyncio.sleep(0.2)  # its request is in progress
    more = [await _connect(port, "127.0.0.2") for _ in range(7)]
    assert (await _get(more[-1])).startswith(b"HTTP/1.1 200")
    # The 9th pushed out the oldest idle one (`wrong`), not the one in the middle of /slow.
    assert await _closed(wrong)
    assert (await asyncio.wait_for(busy[0].read(65536), 10)).startswith(b"HTTP/1.1 200")
    assert not await _closed(trusted, 0.2)
