"""The user-namespace relay's byte pipe, on loopback without namespaces: intact data both ways,
flow control, half-closes, and a reset when the replica does not listen."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from fleetserve.infra import userns


async def _relay_to(port: int) -> tuple[asyncio.AbstractServer, int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(functools.partial(userns._Client, port), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _upstream(handler: object) -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    return server, server.sockets[0].getsockname()[1]


async def test_megabytes_go_through_intact_both_ways_with_a_slow_reader() -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    up, up_port = await _upstream(echo)
    relay, port = await _relay_to(up_port)
    payload = os.urandom(8 * 1024 * 1024)
    r, w = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        w.write(payload)
        await w.drain()
        w.write_eof()

    sender = asyncio.create_task(send())
    got = bytearray()
    while chunk := await r.read(32768):
        got += chunk
        if len(got) < 1024 * 1024:
            await asyncio.sleep(0.001)  # a slow reader at first: the relay must not drop
    await sender
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    w.close()
    relay.close()
    up.close()


async def test_a_half_close_reaches_the_replica_and_its_answer_comes_back() -> None:
    async def until_eof_then_answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = await r.read()  # up to EOF: only a passed-on half-close ends this
        w.write(b"got %d" % len(body))
        await w.drain()
        w.close()

    up, up_port = await _upstream(until_eof_then_answer)
    relay, port = await _relay_to(up_port)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"x" * 1000)
    w.write_eof()
    assert await asyncio.wait_for(r.read(), 5) == b"got 1000"
    w.close()
    relay.close()
    up.close()


async def test_no_replica_listening_resets_the_connection() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens once this closes
    relay, port = await _relay_to(closed_port)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        data: bytes | None = await asyncio.wait_for(r.read(), 5)
    except ConnectionResetError:
        data = None
    assert data is None  # a reset, as from a port nothing listens on; not an orderly close
    w.close()
    relay.close()


def test_probe_and_refusal_of_a_missing_command() -> None:
    with pytest.raises(SystemExit):
        userns.main(["--listen-fd", "3"])  # no port, no command: argparse names them


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_launcher_exits_as_the_replica_did_even_killed_by_sigkill(sig: int) -> None:
    """The controller reads "killed by signal X" from the launcher's status: SIGKILL (the OOM
    killer's) must come through as itself, not as exit code 1."""
    code = f"from fleetserve.infra.userns import _exit_as; _exit_as({-sig})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert proc.returncode == -sig, proc.stderr


async def test_an_ipv6_only_replica_is_reached_and_silence_is_said_in_the_log(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def hello(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"v6")
        await w.drain()
        w.close()

    server = await asyncio.start_server(hello, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    relay, relay_port = await _relay_to(port)
    r, w = await asyncio.open_connection("127.0.0.1", relay_port)
    assert await asyncio.wait_for(r.read(), 5) == b"v6"
    w.close()
    server.close()
    await server.wait_closed()
    userns._said_at[0] = 0.0
    r, w = await asyncio.open_connection("127.0.0.1", relay_port)  # now nothing listens
    with contextlib.suppress(ConnectionResetError):
        await asyncio.wait_for(r.read(), 5)
    w.close()
    relay.close()
    assert f"nothing accepts connections on port {port}" in capsys.readouterr().out
