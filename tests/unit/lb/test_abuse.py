"""No input and no load can freeze, crash or exhaust the load balancer.

Each abuse (request smuggling, header bombs, slowloris, pipelining floods, idle connections up
to the limit, clients that vanish mid-body, HTTP/1.0, a missing Host, Connection-named
headers) gets its exact answer or a close while a well-behaved client keeps getting 200s; the
last test runs them all against a real load-balancer process and checks that its memory and
file descriptors come back. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from fleetserve.core.clock import FakeClock
from fleetserve.lb.config import LbConfig
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import Upstream
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import start_lb_process
from tests.unit.lb.rawhttp import (
    CHUNKED,
    Replica,
    converse,
    good_client,
    parse_responses,
    running,
)
from tests.unit.lb.test_proxy import Start, closed_port, make_lb_proxy, start

__all__ = ["start"]

Serve = Callable[..., Awaitable[tuple[Replica, Proxy, int]]]


@pytest.fixture
async def serve(start: Start) -> AsyncIterator[Serve]:
    """A recording replica behind an in-process load balancer with the given options."""
    replicas: list[Replica] = []

    async def _serve(**options: Any) -> tuple[Replica, Proxy, int]:
        replica = await Replica().start()
        replicas.append(replica)
        _, _, proxy = await make_lb_proxy(
            start, "least_load", [Upstream(1, replica.url, 1)], **options
        )
        return replica, proxy, proxy.port

    yield _serve
    for r in replicas:
        r.close()


def rejected(proxy: Proxy, reason: str) -> float:
    value = proxy.metrics.registry.get_sample_value(
        "fleetserve_lb_rejected_total", {"service": "svc", "reason": reason}
    )
    return value or 0.0


async def eventually(check: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /a HTTP/1.1\r\nHost: x\r\n"
# Each is followed by SMUGGLED: a proxy that reads the framing differently from its replica
# would let the replica see a second request.
BAD_REQUESTS = {
    "CL.TE": POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE.CL": POST + b"Transfer-Encoding: chunked\r\nContent-Length: 6\r\n\r\n0\r\n\r\n",
    "two Content-Lengths": POST + b"Content-Length: 0\r\nContent-Length: 36\r\n\r\n",
    "a Content-Length list": POST + b"Content-Length: 0, 36\r\n\r\n",
    "a signed Content-Length": POST + b"Content-Length: +0\r\n\r\n",
    "TE xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "TE chunked then identity": POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "TE twice": POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n",
    "TE with a space before the colon": POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "TE with a vertical tab": POST + b"Transfer-Encoding: \x0bchunked\r\n\r\n0\r\n\r\n",
    "TE folded": POST + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
    "TE on HTTP/1.0": b"POST /a HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    # (the parser refuses it only after the head: the LB must before it queues the request)
    "TE not ending with chunked": POST + b"Transfer-Encoding: gzip\r\n\r\nabc",
    "bare LF": b"GET /a HTTP/1.1\nHost: x\n\n",
    "bare LF after a header": b"GET /a HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n",
    "bare CR": b"GET /a HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
    "NUL in a header": b"GET /a HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "a chunk size overflow": POST
    + b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff1\r\nabc\r\n0\r\n\r\n",
    "a chunk without its CRLF": POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
    "no Host": b"GET /a HTTP/1.1\r\n\r\n",
    "two Hosts": b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    "an HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}
OTHER_VERSIONS = {
    "HTTP/2.0": b"GET /a HTTP/2.0\r\nHost: x\r\n\r\n",
    "HTTP/0.9": b"GET /a\r\n\r\n",
}


async def test_smuggling_and_malformed_requests_get_400_and_reach_no_replica(
    serve: Serve,
) -> None:
    replica, proxy, port = await serve()
    async with good_client(f"http://127.0.0.1:{port}"):
        for name, request in BAD_REQUESTS.items():
            reply = await converse(port, request + SMUGGLED, read_for=3)
            assert (reply.statuses, reply.closed) == ([400], True), name
        for name, request in OTHER_VERSIONS.items():
            reply = await converse(port, request + SMUGGLED, read_for=3)
            assert (reply.statuses, reply.closed) == ([505], True), name
    assert set(replica.paths()) == {"/good"}  # neither the request nor what it hid
    assert rejected(proxy, "bad_request") == len(BAD_REQUESTS)
    assert rejected(proxy, "http_version") == len(OTHER_VERSIONS)


def head(lines: list[bytes], url: bytes = b"/a") -> bytes:
    return b"GET " + url + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(lines) + b"\r\n"


async def test_header_bombs_get_431_or_414_before_they_are_read_whole(serve: Serve) -> None:
    replica, proxy, port = await serve()
    huge = 20 * 1024 * 1024
    async with good_client(f"http://127.0.0.1:{port}"):
        cases = [
            ("one 20 MB header", head([b"X-Big: " + b"a" * huge + b"\r\n"]), 431),
            ("a 5 MB header that never ends", head([])[:-2] + b"X-Big: " + b"a" * (5 << 20), 431),
            ("101 headers", head([b"X-%d: v\r\n" % i for i in range(100)]), 431),
            (
                "70 headers of 1 KiB",
                head([b"X-%d: %s\r\n" % (i, b"v" * 1024) for i in range(70)]),
                431,
            ),
            ("a 9 KiB URL", head([], b"/" + b"u" * 9 * 1024), 414),
            ("a 5 MB URL that never ends", b"GET /" + b"u" * (5 << 20), 414),
        ]
        for name, request, status in cases:
            reply = await converse(port, request, read_for=5, send_for=5)
            assert (reply.statuses, reply.closed) == ([status], True), name
            assert reply.seconds < 3, name
        # Just under the limits: forwarded.
        fits = head([b"X-%d: v\r\n" % i for i in range(98)], b"/" + b"u" * 8000)
        reply = await converse(port, fits, read_for=0.5)
        assert reply.statuses == [200]
    assert rejected(proxy, "header_bytes") == 3
    assert rejected(proxy, "header_count") == 1
    assert rejected(proxy, "url_bytes") == 2
    assert set(replica.paths()) == {"/good", "/" + "u" * 8000}


async def test_slowloris_gets_408_and_idle_connections_are_closed(serve: Serve) -> None:
    replica, proxy, port = await serve(header_timeout_seconds=0.5, idle_timeout_seconds=0.6)
    async with good_client(f"http://127.0.0.1:{port}"):
        # A head sent one line every 0.1 s (it would take 5 s): 408 once 0.5 s have passed.
        lines = [b"GET /slow HTTP/1.1\r\n", *[b"X-%d: v\r\n" % i for i in range(50)], b"\r\n"]
        reply = await converse(port, lines, pause=0.1, read_for=4)
        assert (reply.statuses, reply.closed) == ([408], True)
        assert 0.5 <= reply.seconds < 2.0
        # A connection that never sends a byte: closed silently after the header timeout.
        reply = await converse(port, [], read_for=4)
        assert (reply.data, reply.closed) == (b"", True)
        assert 0.5 <= reply.seconds < 2.0
        # Keep-alive, then nothing: the answer, then a silent close after the idle timeout.
        reply = await converse(port, b"GET /once HTTP/1.1\r\nHost: x\r\n\r\n", read_for=4)
        assert (reply.statuses, reply.closed) == ([200], True)
        assert 0.6 <= reply.seconds < 2.0
    assert rejected(proxy, "header_timeout") == 2
    assert rejected(proxy, "idle_timeout") == 1
    assert "/slow" not in replica.paths()


async def test_timeouts_run_on_the_load_balancers_clock(serve: Serve) -> None:
    """The default timeouts (a head in 10 s, 75 s idle) without waiting for them: the load
    balancer reads an injected clock (fleetserve.core.clock), here a fake one moved by hand;
    its sweep (every second) closes what the fake time made late."""
    clock = FakeClock()
    _, proxy, port = await serve(clock=clock)
    loop = asyncio.get_running_loop()
    silent, idle = socket.socket(), socket.socket()
    for sock in (silent, idle):
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(idle, b"GET /once HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 200 " in await asyncio.wait_for(loop.sock_recv(idle, 1 << 16), 5)
    clock.advance(12)  # past the head's 10 s (and a sweep): the silent one goes
    await eventually(lambda: rejected(proxy, "header_timeout") == 1)
    assert rejected(proxy, "idle_timeout") == 0  # 12 s of 75 idle
    assert await asyncio.wait_for(loop.sock_recv(silent, 1), 5) == b""
    clock.advance(65)  # 77 s idle
    await eventually(lambda: rejected(proxy, "idle_timeout") == 1)
    assert await asyncio.wait_for(loop.sock_recv(idle, 1), 5) == b""
    silent.close()
    idle.close()


async def test_pipelined_requests_wait_in_the_socket_not_in_memory(serve: Serve) -> None:
    replica, proxy, port = await serve()
    replica.wait_seconds = 0.01
    most_queued = most_kept = 0

    async def watch() -> None:
        nonlocal most_queued, most_kept
        while True:
            for c in proxy.clients:
                most_queued = max(most_queued, len(c.queue))
                most_kept = max(most_kept, len(getattr(c, "backlog", b"")))
            await asyncio.sleep(0.002)

    async with good_client(f"http://127.0.0.1:{port}"):
        burst = b"".join(b"GET /wait/%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(40))
        async with running(watch()):
            reply = await converse(port, burst, read_for=1.5)
        responses = parse_responses(reply.data)
        assert [r.status for r in responses] == [200] * 40
        assert [json.loads(r.body)["path"] for r in responses] == [f"/wait/{i}" for i in range(40)]
        assert 1 < most_queued <= 16  # the default max_pipelined_requests
        assert most_kept <= len(burst)  # what was read stayed one read
        # A read that ends a body and carries more requests than the queue takes: those
        # beyond it get a 429, after the ones before it are answered.
        first = b"POST /wait/body HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\na"
        rest = b"bc" + b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" * 40
        reply = await converse(port, [first, rest], pause=0.1, read_for=3)
        assert (reply.statuses, reply.closed) == ([200] * 16 + [429], True)
        # A client that leaves while its requests wait: what waits is dropped (its socket is
        # still read while what waits is small, so its close shows at once).
        replica.wait_seconds = 0.3
        burst = b"".join(b"GET /wait/left-%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(40))
        await converse(port, burst, read_for=0.1)
        await asyncio.sleep(0.8)
        left = [p for p in replica.paths() if p.startswith("/wait/left")]
        assert left == ["/wait/left-0"]
    assert rejected(proxy, "pipelined") == 1


async def test_connections_past_the_limit_get_503_and_close_at_once(serve: Serve) -> None:
    replica, proxy, port = await serve(max_connections=20)
    loop = asyncio.get_running_loop()
    idle: list[socket.socket] = []
    try:
        async with good_client(f"http://127.0.0.1:{port}"):
            for _ in range(19):  # up to the limit, with the good client's connection
                sock = socket.socket()
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", port))
                idle.append(sock)
            await eventually(lambda: len(proxy.clients) == 20)
            for _ in range(5):
                reply = await converse(port, b"GET /over HTTP/1.1\r\nHost: x\r\n\r\n", read_for=2)
                assert (reply.statuses, reply.closed) == ([503], True)
                assert reply.seconds < 1
            for sock in idle[:5]:
                sock.close()
            await eventually(lambda: len(proxy.clients) == 15)
            reply = await converse(port, b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n", read_for=0.5)
            assert reply.statuses == [200]
    finally:
        for sock in idle:
            sock.close()
    assert rejected(proxy, "connections") == 5
    assert "/over" not in replica.paths()


async def test_a_client_gone_mid_body_cancels_the_replica_request(serve: Serve) -> None:
    replica, proxy, port = await serve()
    loop = asyncio.get_running_loop()
    async with good_client(f"http://127.0.0.1:{port}"):
        for framing in (b"Content-Length: 1000000\r\n", b"Transfer-Encoding: chunked\r\n"):
            for _ in range(5):
                sock = socket.socket()
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", port))
                body = b"x" * 100_000
                if framing.startswith(b"Transfer"):
                    body = b"%x\r\n%s\r\n" % (len(body), body)
                await loop.sock_sendall(sock, b"POST /upload HTTP/1.1\r\nHost: x\r\n" + framing)
                await loop.sock_sendall(sock, b"\r\n" + body)
                await eventually(lambda: 1 in proxy.replicas.inflight)
                sock.close()
                await eventually(lambda: not proxy.replicas.inflight and len(proxy.clients) == 1)
        # A body whose chunk framing breaks mid-way: 400 and close, the request cancelled.
        broken = b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        reply = await converse(port, [broken + b"3\r\nabc\r\n", b"zz\r\n"], pause=0.1)
        assert (reply.statuses, reply.closed) == ([400], True)
        await eventually(lambda: not proxy.replicas.inflight and len(proxy.clients) == 1)
    await eventually(lambda: replica.open_connections <= 1)  # the good client's pooled one
    assert "/upload" not in replica.paths()


async def test_http10_clients_get_no_chunked_framing_and_their_keep_alive(serve: Serve) -> None:
    replica, _, port = await serve()
    async with good_client(f"http://127.0.0.1:{port}"):
        # A chunked response to HTTP/1.0: de-chunked, and it ends with the connection.
        reply = await converse(port, b"GET /chunked HTTP/1.0\r\nHost: x\r\n\r\n", read_for=2)
        assert reply.closed
        head, _, body = reply.data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower()
        assert b"\r\nConnection: close" in head
        assert body == b"hello world"
        # Keep-alive asked: kept while the length is known, not when it is not.
        ka = b"Connection: keep-alive\r\n"
        reply = await converse(
            port,
            [
                b"GET /one HTTP/1.0\r\nHost: x\r\n" + ka + b"\r\n",
                b"GET /chunked HTTP/1.0\r\nHost: x\r\n" + ka + b"\r\n",
            ],
            pause=0.2,
            read_for=2,
        )
        assert reply.closed
        first, second = reply.data.split(b"HTTP/1.1 200 OK", 2)[1:]
        assert b"\r\nConnection: keep-alive\r\n" in first and b'"/one"' in first
        assert b"\r\nConnection: close\r\n" in second and second.endswith(b"hello world")
        assert b"Transfer-Encoding" not in second
        # No Host is fine in HTTP/1.0: the replica gets one (it is sent HTTP/1.1).
        reply = await converse(port, b"GET /nohost HTTP/1.0\r\n\r\n", read_for=2)
        assert reply.statuses == [200] and reply.closed
    nohost = next(s for s in replica.seen if s.path == "/nohost")
    assert nohost.headers["host"] == f"127.0.0.1:{port}"


async def test_connection_named_headers_are_dropped_both_ways(serve: Serve) -> None:
    replica, _, port = await serve()
    async with good_client(f"http://127.0.0.1:{port}"):
        # Naming Content-Length must not unframe the body (it would smuggle it).
        request = (
            b"POST /hop HTTP/1.1\r\nHost: x\r\nConnection: X-Secret, Content-Length, close\r\n"
            b"X-Secret: s\r\nKeep-Alive: 5\r\nX-Kept: k\r\nContent-Length: 5\r\n\r\nhello"
        )
        reply = await converse(port, request, read_for=2)
        (response,) = parse_responses(reply.data)
        assert response.status == 200 and response.body == b"ok"
        assert response.header(b"x-kept") == b"yes"
        for name in (b"x-hop", b"keep-alive"):
            assert response.header(name) is None, name
        # the replica's Connection header is dropped; the client asked to close: it is told
        assert response.header(b"connection") == b"close"
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{port}/hop-chunked") as r,
        ):
            assert r.status == 200 and await r.read() == b"hello world"
            assert "X-Hop" not in r.headers and r.headers["X-Kept"] == "yes"
    seen = next(s for s in replica.seen if s.path == "/hop")
    assert seen.body == b"hello" and seen.headers["content-length"] == "5"
    assert seen.headers["x-kept"] == "k"
    assert "x-secret" not in seen.headers and "keep-alive" not in seen.headers


async def test_a_client_that_asks_to_close_is_told_so_and_the_body_passes_through(
    serve: Serve,
) -> None:
    """An HTTP/1.1 request with `Connection: close`: the replica's plain head (no hop-by-hop
    header; it passes through untouched otherwise) gets `Connection: close`, its body, chunked
    or not, is the replica's byte for byte, and the connection ends after it."""
    _, _, port = await serve()
    for path, body in ((b"/one", None), (b"/chunked", CHUNKED)):
        request = b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path
        reply = await converse(port, request, read_for=2)
        assert reply.closed
        head, _, rest = reply.data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert head.lower().count(b"\r\nconnection:") == 1 and head.endswith(
            b"\r\nConnection: close"
        )
        if body is not None:
            assert rest == body
        else:
            assert b'"/one"' in rest


# -- the load balancer as a real process: memory and file descriptors come back ------------


@pytest.fixture
async def lb_process(tmp_path: Path) -> AsyncIterator[tuple[LbConfig, psutil.Process]]:
    config = LbConfig(
        service="abuse",
        port=closed_port(),
        admin_port=closed_port(),
        options=LoadBalancerOptions(
            workers=1, max_connections=200, header_timeout_seconds=1, idle_timeout_seconds=1
        ),
    )
    proc = await start_lb_process(config, tmp_path)
    try:
        yield config, psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def flood(port: int, data: bytes, seconds: float) -> None:
    """Write `data` for at most `seconds` without reading a byte, then close."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(seconds):
                await loop.sock_sendall(sock, data)
    finally:
        sock.close()


async def test_the_process_comes_back_to_its_baseline_after_abuse(
    lb_process: tuple[LbConfig, psutil.Process],
) -> None:
    config, proc = lb_process
    replica = await Replica().start()
    port = config.port
    try:
        async with aiohttp.ClientSession() as s:
            push = {"replicas": [{"replica_id": 1, "url": replica.url}]}
            async with s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=push) as r:
                assert r.status == 200
        async with good_client(f"http://127.0.0.1:{port}", every=0.01) as good:
            await eventually(lambda: len(good.statuses) >= 100)  # warmed up
            rss0, fds0 = proc.memory_info().rss, proc.num_fds()
            peak = rss0

            async def sample() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, proc.memory_info().rss)
                    await asyncio.sleep(0.05)

            async with running(sample()):
                unterminated = head([])[:-2] + b"X-Big: " + b"a" * (5 << 20)
                for _ in range(3):  # rounds of unterminated 5 MB heads, four at once
                    replies = await asyncio.gather(
                        *(converse(port, unterminated, read_for=5, send_for=5) for _ in range(4))
                    )
                    assert all(r.statuses == [431] and r.closed for r in replies)
                bomb = head([b"X-Big: " + b"a" * (20 << 20) + b"\r\n"])
                reply = await converse(port, bomb, read_for=5, send_for=5)
                assert reply.statuses == [431]
                pipelined = b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n" * 300_000  # 8.7 MB, never read
                await asyncio.gather(*(flood(port, pipelined, 1.5) for _ in range(2)))
                for request in BAD_REQUESTS.values():
                    reply = await converse(port, request + SMUGGLED, read_for=3)
                    assert reply.statuses == [400]
                # Idle connections past the limit: those over it get a 503; then, silent, they
                # are all closed by the header timeout.
                replies = await asyncio.gather(
                    *(converse(port, [], read_for=4) for _ in range(230))
                )
                answered = [tuple(r.statuses) for r in replies]
                assert answered.count((503,)) >= 31  # 200 less the good client's connection
                assert answered.count((503,)) + answered.count(()) == 230
                assert all(r.closed for r in replies)
                for _ in range(10):
                    await flood(
                        port,
                        b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n"
                        + b"x" * 50_000,
                        0.2,
                    )
            await eventually(lambda: proc.num_fds() <= fds0 + 2, seconds=10)
            rss1 = proc.memory_info().rss
        print(f"LB RSS: baseline {rss0 >> 20} MiB, peak {peak >> 20} MiB, after {rss1 >> 20} MiB")
        assert peak - rss0 < 60 << 20  # before the limits: +400 MiB, and 260 MiB kept
        assert rss1 - rss0 < 25 << 20
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{config.admin_port}/metrics") as r,
        ):
            metrics = await r.text()
        for reason in ("header_bytes", "bad_request", "connections", "header_timeout"):
            line = f'fleetserve_lb_rejected_total{{reason="{reason}",service="abuse"}}'
            assert line in metrics and f"{line} 0.0" not in metrics, reason
    finally:
        replica.close()


async def test_one_client_address_past_its_limit_gets_503_and_others_are_served(
    serve: Serve,
) -> None:
    """max_connections_per_client: 127.0.0.2 holds its 3 connections; its 4th gets a 503 and is
    closed, while 127.0.0.1 is served; a freed connection lets 127.0.0.2 in again."""
    replica, proxy, port = await serve(max_connections_per_client=3)
    loop = asyncio.get_running_loop()

    async def connect_from(address: str) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((address, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        return sock

    async def ask(sock: socket.socket, path: str) -> bytes:
        await loop.sock_sendall(sock, b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        return await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)

    held = [await connect_from("127.0.0.2") for _ in range(3)]
    try:
        await eventually(lambda: proxy.per_client.get(b"127.0.0.2") == 3)
        over = await connect_from("127.0.0.2")  # answered at once, before it sends anything
        answer = await asyncio.wait_for(loop.sock_recv(over, 65536), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections_from_client" in answer
        assert await asyncio.wait_for(loop.sock_recv(over, 100), 5) == b""  # and closed
        over.close()
        reply = await converse(port, b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n", read_for=0.5)
        assert reply.statuses == [200]  # another address is not held back
        assert (await ask(held[0], "/mine")).startswith(b"HTTP/1.1 200")
        held.pop().close()
        await eventually(lambda: proxy.per_client.get(b"127.0.0.2") == 2)
        again = await connect_from("127.0.0.2")
        held.append(again)
        assert (await ask(again, "/again")).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    await eventually(lambda: proxy.per_client == {})
    assert rejected(proxy, "client_connections") == 1
    assert "/again" in replica.paths()


async def test_connect_gets_405_and_several_forwarded_for_lines_stay_one_list(
    serve: Serve,
) -> None:
    replica, proxy, port = await serve()
    reply = await converse(port, b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n" + SMUGGLED)
    assert (reply.statuses, reply.closed) == ([405], True)
    assert rejected(proxy, "bad_request") == 1
    two = head([b"X-Forwarded-For: 192.0.2.1\r\n", b"X-Forwarded-For: 192.0.2.2, 192.0.2.3\r\n"])
    reply = await converse(port, two, read_for=1)
    assert reply.statuses == [200]
    assert replica.paths() == ["/a"]
    forwarded = replica.seen[0].headers["x-forwarded-for"]
    assert forwarded == "192.0.2.1, 192.0.2.2, 192.0.2.3, 127.0.0.1"


CHUNKED_POST = POST + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"


async def test_trailers_are_bounded_as_a_head_is(serve: Serve) -> None:
    _, proxy, port = await serve()
    async with good_client(f"http://127.0.0.1:{port}"):
        # A few trailer fields: the request passes (its trailers are not passed on).
        reply = await converse(port, CHUNKED_POST + b"X-T: 1\r\nX-U: 2\r\n\r\n", read_for=1)
        assert reply.statuses == [200]
        cases = [
            ("101 trailer fields", b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n"),
            (
                "70 trailer fields of 1 KiB",
                b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1024) for i in range(70)),
            ),
            ("a 5 MB trailer that never ends", b"X-Big: " + b"a" * (5 << 20)),
            ("20 MB of trailer lines", b"X-A: b\r\n" * (20 << 17)),
        ]
        for name, trailer in cases:
            reply = await converse(port, CHUNKED_POST + trailer, read_for=5, send_for=5)
            assert (reply.statuses, reply.closed) == ([431], True), name
            assert reply.seconds < 3, name
    assert rejected(proxy, "header_count") + rejected(proxy, "header_bytes") == len(cases)


class _RawReplica(asyncio.Protocol):
    """Answers every head it reads with `answer` on a kept-alive connection, whatever the
    head asks (a replica that ignores an Upgrade it cannot serve), and records the bytes."""

    def __init__(self, answer: bytes, got: list[bytes], conns: list[int]) -> None:
        self.answer, self.got, self.conns = answer, got, conns
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.conns.append(1)

    def data_received(self, data: bytes) -> None:
        self.got.append(data)
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            _, _, self.buf = self.buf.partition(b"\r\n\r\n")
            self.transport.write(self.answer)  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def lb_in_front(
    start: Start, replica: Callable[[], asyncio.Protocol]
) -> AsyncIterator[Proxy]:
    """An in-process load balancer (least_load) before one replica of `replica`'s protocol."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(replica, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        _, _, proxy = await make_lb_proxy(start, "least_load", [Upstream(1, url, 1)])
        yield proxy
    finally:
        server.close()


def raw_replica(answer: bytes) -> tuple[Callable[[], asyncio.Protocol], list[bytes], list[int]]:
    """A _RawReplica answering `answer`: its factory, the bytes it got, its connections."""
    got: list[bytes] = []
    conns: list[int] = []
    return (lambda: _RawReplica(answer, got, conns)), got, conns


UPGRADE = b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"


async def test_a_declined_upgrade_sends_nothing_after_its_head_and_reuses_no_connection(
    start: Start,
) -> None:
    # What a client sends after an Upgrade request's head belongs to the tunnel: a replica
    # that declines the upgrade must never read it as a request of its own (its answer would
    # reach the next client of a pooled connection).
    replica, got, conns = raw_replica(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno")
    async with lb_in_front(start, replica) as proxy:
        reply = await converse(proxy.port, UPGRADE + SMUGGLED, read_for=3)
        assert (reply.statuses, reply.closed) == ([200], True)
        assert b"/smuggled" not in b"".join(got)
        # The next request goes on a new connection to the replica, not the declined one.
        reply = await converse(proxy.port, b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n", read_for=1)
        assert reply.statuses == [200]
        assert len(conns) == 2


async def test_a_101_to_a_request_that_asked_no_upgrade_is_a_502(start: Start) -> None:
    replica, _, _ = raw_replica(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n"
    )
    async with lb_in_front(start, replica) as proxy:
        reply = await converse(proxy.port, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", read_for=2)
        assert reply.statuses == [502]


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        # a second response, unasked for, in the same packet as the first
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
            b"ok",
        ),
        # a Content-Length one byte short (a UTF-8 miscount)
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok!", b"ok"),
        # the same on the slow path (a connection-specific header to drop)
        (
            b"HTTP/1.1 200 OK\r\nKeep-Alive: 5\r\nContent-Length: 2\r\n\r\nok"
            b"HTTP/1.1 200 OK\r\n\r\n",
            b"ok",
        ),
    ],
)
async def test_bytes_past_a_response_never_reach_the_client(
    start: Start, answer: bytes, body: bytes
) -> None:
    """A replica that sends more than its response: the client gets the response as framed
    (not a 502, not a second response it would take for its next request's), and the
    connection to the replica is not used again."""
    replica, _, conns = raw_replica(answer)
    async with lb_in_front(start, replica) as proxy:
        two = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
        reply = await converse(proxy.port, two, read_for=1.5)
        got = parse_responses(reply.data)
        assert [(r.status, r.body) for r in got] == [(200, body), (200, body)]
        assert b"evil" not in reply.data
        assert len(conns) == 2  # one connection per response: none was reused


class _LateBody(asyncio.Protocol):
    """A replica that answers /late with a 204 head, then 0.3 s later writes a response
    nobody asked for on the same connection; anything else with a plain 200 naming it."""

    def __init__(self, conns: list[int]) -> None:
        self.conns, self.buf = conns, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.conns.append(1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            path = head.split(b" ")[1]
            write = self.transport.write  # type: ignore[attr-defined]
            if path == b"/late":
                write(b"HTTP/1.1 204 No Content\r\n\r\n")
                evil = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"
                asyncio.get_running_loop().call_later(0.3, write, evil)
            else:
                write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(path), path))


async def test_a_bodiless_response_passes_no_byte_after_its_head(start: Start) -> None:
    """HEAD, 204 and 304 answers have no body: bytes a replica sends after their head (a HEAD
    answered as a GET; a 204 followed later by more) reach no client, and the connection is
    not used again (they came as the next request's answer, or made it a 502)."""
    replica, _, conns = raw_replica(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!")
    async with lb_in_front(start, replica) as proxy:
        two = b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        reply = await converse(proxy.port, two, read_for=1.5)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
        assert reply.data == head + head + b"EVIL!"  # the HEAD's head alone, then the GET's
        assert len(conns) == 2
    late: list[int] = []
    async with lb_in_front(start, lambda: _LateBody(late)) as proxy:
        first = await converse(proxy.port, b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n", read_for=0.5)
        assert first.data == b"HTTP/1.1 204 No Content\r\n\r\n"
        await asyncio.sleep(0.5)  # the replica's stray bytes come meanwhile
        second = await converse(proxy.port, b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n", read_for=1)
        assert [(r.status, r.body) for r in parse_responses(second.data)] == [(200, b"/next")]


async def test_several_transfer_encoding_lines_reach_the_replica_as_one(serve: Serve) -> None:
    replica, _, port = await serve()
    request = (
        POST + b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    reply = await converse(port, request, read_for=1)
    assert reply.statuses == [200]
    (seen,) = replica.seen
    assert seen.headers["transfer-encoding"] == "gzip, chunked" and seen.body == b"abc"


async def test_an_upgrade_request_with_a_body_is_refused_not_left_hanging(serve: Serve) -> None:
    replica, proxy, port = await serve()
    for framing, body in (
        (b"Content-Length: 3\r\n", b"abc"),
        (b"Transfer-Encoding: chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    ):
        request = UPGRADE[:-2] + framing + b"\r\n" + body
        reply = await converse(port, request, read_for=3)
        assert (reply.statuses, reply.closed) == ([400], True), framing
        assert reply.seconds < 2
    assert replica.seen == []
    assert rejected(proxy, "bad_request") == 2


class _ClosingReplica(asyncio.Protocol):
    """Answers its first request with `answer`, then closes the connection: a body framed by
    neither Content-Length nor chunked ends there (an HTTP/1.0 server)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            self.transport.write(self.answer)  # type: ignore[attr-defined]
            self.transport.close()


def upstream_errors(proxy: Proxy) -> float:
    return sum(
        s.value
        for m in proxy.metrics.registry.collect()
        for s in m.samples
        if s.name == "fleetserve_lb_upstream_errors_total"
    )


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, all of it",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello, all of it",
    ],
    ids=["http10", "connection-close"],
)
async def test_a_body_that_ends_with_its_connection_is_whole_not_an_error(
    start: Start, answer: bytes
) -> None:
    """A response with no Content-Length and no chunked framing ends when the replica closes:
    the client gets all of it and the end (the connection closes), and the load balancer
    counts no failed attempt (it counted each as a `mid_response` error, which made such a
    replica look broken)."""
    async with lb_in_front(start, lambda: _ClosingReplica(answer)) as proxy:
        for _ in range(3):
            reply = await converse(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", read_for=3)
            assert reply.statuses == [200]
            assert reply.data.endswith(b"hello, all of it") and reply.closed
        assert upstream_errors(proxy) == 0


async def test_a_close_delimited_body_cut_by_a_reset_is_still_an_error(start: Start) -> None:
    """A head that says how long its body is, then the connection closes short: cut."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"
    async with lb_in_front(start, lambda: _ClosingReplica(answer)) as proxy:
        reply = await converse(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", read_for=3)
        assert reply.closed
        assert upstream_errors(proxy) == 1


class _ScriptedReplica(asyncio.Protocol):
    """Answers its first request with `pieces`, 50 ms apart, then closes."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            asyncio.get_running_loop().create_task(self._answer())

    async def _answer(self) -> None:
        for piece in self.pieces:
            self.transport.write(piece)  # type: ignore[attr-defined]
            await asyncio.sleep(0.05)
        self.transport.close()


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"],
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"],
        [
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        ],
    ],
    ids=["100-same-read", "100-two-reads", "103-chunked"],
)
async def test_a_body_cut_short_after_an_interim_answer_is_still_an_error(
    start: Start, pieces: list[bytes]
) -> None:
    """After a 1xx, the final answer's head is not the first read's: a body shorter than its
    Content-Length, or a chunked body without its end, is a failure when the replica closes
    (found by an outside review: it was taken for a body that ends with its connection)."""
    async with lb_in_front(start, lambda: _ScriptedReplica(pieces)) as proxy:
        reply = await converse(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", read_for=3)
        assert reply.closed
        assert upstream_errors(proxy) == 1


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTTP/1.0 200 OK\r\n", b"Content-Type: text/plain\r\n\r\nhello, all of it"],
        [b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n", b"\r\nhello, all of it"],
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello, all of it"],
    ],
    ids=["status-line-alone", "head-end-alone", "transfer-encoding-not-chunked"],
)
async def test_a_whole_close_delimited_answer_is_no_error_however_its_head_comes(
    start: Start, pieces: list[bytes]
) -> None:
    """A head in several reads, or a Transfer-Encoding whose last coding is not chunked (its
    body ends with the connection: RFC 9112 6.3), is still a whole answer (second review)."""
    async with lb_in_front(start, lambda: _ScriptedReplica(pieces)) as proxy:
        reply = await converse(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", read_for=3)
        assert reply.statuses == [200] and reply.closed
        assert reply.data.endswith(b"hello, all of it")
        assert upstream_errors(proxy) == 0


async def test_blank_lines_before_the_status_line_do_not_hide_its_length(start: Start) -> None:
    pieces = [b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"]
    async with lb_in_front(start, lambda: _ScriptedReplica(pieces)) as proxy:
        reply = await converse(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", read_for=3)
        assert reply.closed
        assert upstream_errors(proxy) == 1
