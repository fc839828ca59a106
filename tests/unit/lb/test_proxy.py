"""The load balancer on real loopback sockets: routing, streaming, retries, admin API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleetserve.core.clock import FakeClock, SystemClock
from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.config import LbConfig
from fleetserve.lb.metrics import LATENCY_BUCKETS
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.factory import make_selector, selector_for
from fleetserve.spec.models import LoadBalancerOptions

Start = Callable[[web.Application | Proxy], Awaitable[int]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Serve an aiohttp app (a replica, the admin API) or the proxy on a loopback port."""
    runners: list[web.AppRunner] = []
    proxies: list[Proxy] = []

    async def _start(app: web.Application | Proxy) -> int:
        if isinstance(app, Proxy):
            await app.serve("127.0.0.1", 0)
            proxies.append(app)
            return app.port
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return int(runner.addresses[0][1])

    yield _start
    for p in proxies:
        await p.close()
    for r in reversed(runners):
        await r.cleanup()


def upstream_app(name: str, seen: list[dict[str, Any]] | None = None) -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        if request.path == "/stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.3)
            await resp.write_eof()
            return resp
        if request.path == "/slow":
            await asyncio.sleep(30)
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
        if seen is not None:
            seen.append({"method": request.method, "headers": dict(request.headers), "size": size})
        return web.json_response(
            {"replica": name, "method": request.method, "bytes": size, "path": request.path_qs},
            headers={"X-Replica": name},
        )

    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(policy: str = "least_load", **options: Any) -> LbConfig:
    hold = options.pop("hold_when_empty", False)
    return LbConfig(
        service="svc",
        port=0,
        admin_port=0,
        policy=policy,  # type: ignore[arg-type]
        options=LoadBalancerOptions(**options),
        hold_when_empty=hold,
    )


async def make_lb(
    start: Start, policy: str, upstreams: list[Upstream], **options: Any
) -> tuple[str, ReplicaSet]:
    lb, replicas, _ = await make_lb_proxy(start, policy, upstreams, **options)
    return lb, replicas


async def make_lb_proxy(
    start: Start,
    policy: str,
    upstreams: list[Upstream],
    clock: FakeClock | None = None,
    **options: Any,
) -> tuple[str, ReplicaSet, Proxy]:
    """A load balancer on loopback; with `clock`, it reads that fake clock's time."""
    cfg = config(policy, **options)
    monotonic = (clock or SystemClock()).monotonic
    replicas = ReplicaSet(make_selector("least_load"), monotonic)
    replicas.selector = selector_for(policy, cfg.options, replicas.weights)
    replicas.replace(upstreams)
    proxy = Proxy(cfg, replicas, clock=clock)
    port = await start(proxy)
    return f"http://127.0.0.1:{port}", replicas, proxy


async def test_round_robin_reaches_every_replica_and_all_methods_pass(start: Start) -> None:
    a = await start(upstream_app("a"))
    b = await start(upstream_app("b"))
    lb, _ = await make_lb(
        start,
        "round_robin",
        [Upstream(1, f"http://127.0.0.1:{a}", 1), Upstream(2, f"http://127.0.0.1:{b}", 1)],
    )
    async with aiohttp.ClientSession() as s:
        names = []
        for _ in range(4):
            async with s.get(f"{lb}/x?q=1") as r:
                body = await r.json()
                names.append(body["replica"])
                assert body["path"] == "/x?q=1"
        assert names == ["a", "b", "a", "b"]
        for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
            async with s.request(method, f"{lb}/m", data=b"abc") as r:
                assert r.status == 200
                assert (await r.json())["method"] == method
        async with s.head(f"{lb}/h") as r:
            assert r.status == 200 and r.headers["X-Replica"] in ("a", "b")


async def test_forwarded_headers_and_no_hop_by_hop(start: Start) -> None:
    seen: list[dict[str, Any]] = []
    a = await start(upstream_app("a", seen))
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{lb}/", headers={"X-Custom": "1", "Proxy-Authorization": "secret"}) as r,
    ):
        assert r.status == 200
    headers = seen[0]["headers"]
    assert headers["X-Custom"] == "1"
    assert headers["X-Forwarded-For"] == "127.0.0.1"
    assert "Proxy-Authorization" not in headers


async def test_response_is_streamed_not_buffered(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s, s.get(f"{lb}/stream") as r:
        t0 = loop.time()
        first = await r.content.readuntil(b"\n\n")
        t_first = loop.time() - t0
        rest = await r.read()
        t_all = loop.time() - t0
    assert first == b"data: 0\n\n"
    assert rest == b"data: 1\n\ndata: 2\n\n"
    assert t_first < 0.25 < t_all  # the first event came before the upstream finished


async def test_large_upload_is_streamed_through(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    size = 20 * 1024 * 1024

    async def body() -> AsyncIterator[bytes]:
        chunk = b"x" * (1024 * 1024)
        for _ in range(size // len(chunk)):
            yield chunk

    async with aiohttp.ClientSession() as s, s.post(f"{lb}/upload", data=body()) as r:
        assert r.status == 200
        assert (await r.json())["bytes"] == size


async def test_connection_refused_is_retried_on_another_replica(start: Start) -> None:
    a = await start(upstream_app("a"))
    dead = closed_port()
    lb, replicas = await make_lb(
        start,
        "round_robin",
        [Upstream(1, f"http://127.0.0.1:{dead}", 1), Upstream(2, f"http://127.0.0.1:{a}", 1)],
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.post(f"{lb}/", data=b"payload") as r:
                assert r.status == 200
                assert (await r.json())["bytes"] == 7
    assert set(replicas.upstreams) == {2}  # the dead one is out of rotation until the next push


async def test_no_ready_replica_is_a_clear_503_and_all_dead_is_502(start: Start) -> None:
    lb, replicas = await make_lb(start, "least_load", [])
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{lb}/") as r:
            assert r.status == 503
            body = await r.json()
            assert (
                body["error"] == "no_ready_replicas" and "fleetserve status svc" in body["message"]
            )
        replicas.replace([Upstream(1, f"http://127.0.0.1:{closed_port()}", 1)])
        async with s.get(f"{lb}/") as r:
            assert r.status == 502
            assert "replica 1" in (await r.json())["message"]


async def test_client_disconnect_cancels_upstream_and_releases_in_flight(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, replicas = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.get(f"{lb}/slow", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        for _ in range(50):
            if not replicas.inflight:
                break
            await asyncio.sleep(0.05)
    assert replicas.inflight == {}


async def test_admin_push_replaces_the_set_and_rejects_bad_payloads(start: Start) -> None:
    replicas = ReplicaSet(make_selector("least_load"))
    port = await start(make_admin_app(Proxy(config(), replicas)))
    url = f"http://127.0.0.1:{port}/-/replicas"
    async with aiohttp.ClientSession() as s:
        async with s.put(
            url, json={"replicas": [{"replica_id": 3, "url": "http://127.0.0.1:1"}]}
        ) as r:
            assert r.status == 200
        assert set(replicas.upstreams) == {3}
        async with s.put(url, json={"replicas": [{"replica_id": "x"}]}) as r:
            assert r.status == 400
            assert "invalid_payload" in await r.text()
        async with s.put(url, data=b"not json") as r:
            assert r.status == 400
        assert set(replicas.upstreams) == {3}  # a bad push changes nothing
        async with s.get(url) as r:
            assert (await r.json())["replicas"][0]["replica_id"] == 3


async def test_a_malformed_request_gets_a_400_and_the_lb_carries_on(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    host, port = lb.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\nBad Header Line\r\n\r\n")
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b" 400 " in status_line, status_line
    async with aiohttp.ClientSession() as s, s.get(f"{lb}/after") as r:
        assert r.status == 200


async def start_dropper() -> tuple[asyncio.Server, list[int]]:
    """A replica that reads a request's head and closes without a byte of answer (it died),
    and the requests it dropped (one item each)."""
    dropped: list[int] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        dropped.append(1)
        writer.transport.abort()

    return await asyncio.start_server(drop, "127.0.0.1", 0), dropped


async def test_a_request_the_replica_dropped_unanswered_is_retried_elsewhere(start: Start) -> None:
    """A replica that reads the request and closes without a byte of answer (it died): the
    POST, body included, goes to another replica instead of failing."""
    server, dropped = await start_dropper()
    bad = server.sockets[0].getsockname()[1]
    good = await start(upstream_app("good"))
    lb, _ = await make_lb(
        start,
        "round_robin",
        [Upstream(1, f"http://127.0.0.1:{bad}", 1), Upstream(2, f"http://127.0.0.1:{good}", 1)],
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(f"{lb}/", data=b"x" * 1000) as r:
                    assert r.status == 200
                    body = await r.json()
                    assert body["replica"] == "good" and body["bytes"] == 1000
        assert len(dropped) >= 1
    finally:
        server.close()


async def test_a_retried_requests_first_byte_counts_from_the_attempt_that_answered(
    start: Start,
) -> None:
    """The first replica holds the request 0.5 s and drops it unanswered; the second answers
    its head after 0.2 s: the first byte took 0.2 s (that attempt's), the request 0.7 s. On a
    fake clock that the replicas move: exact figures, and no real waiting."""
    dropped = 0
    clock = FakeClock()

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dropped
        await reader.readuntil(b"\r\n\r\n")
        dropped += 1
        clock.advance(0.5)
        writer.transport.abort()

    async def late(request: web.Request) -> web.Response:
        clock.advance(0.2)
        return web.Response(text="ok")

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    bad = server.sockets[0].getsockname()[1]
    app = web.Application()
    app.router.add_get("/", late)
    good = await start(app)
    lb, _, proxy = await make_lb_proxy(
        start,
        "round_robin",
        [Upstream(1, f"http://127.0.0.1:{bad}", 1), Upstream(2, f"http://127.0.0.1:{good}", 1)],
        clock=clock,
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # round robin: one of the two starts on the dropping replica
                async with s.get(f"{lb}/") as r:
                    assert r.status == 200
    finally:
        server.close()
    totals = proxy.metrics.totals()
    bounds = list(LATENCY_BUCKETS)
    answered = totals["2"]
    assert answered.first_byte[bounds.index(0.1)] == 0
    # Both 0.2 s, a retried one too (from its request's start it would be 0.7 s).
    assert answered.first_byte[bounds.index(0.25)] == 2
    assert dropped in (1, 2)
    assert answered.latency[bounds.index(0.25)] == 2 - dropped  # a retried one took 0.7 s
    assert answered.latency[bounds.index(0.5)] == 2 - dropped
    assert answered.latency[bounds.index(1)] == 2
    assert totals["1"].first_byte == [0] * (len(bounds) + 1)  # it never answered


async def test_first_byte_is_the_bodys_not_the_head_sent_at_once(start: Start) -> None:
    """A streaming LLM server (vLLM) sends its head as soon as it takes the request and its
    first token after the prefill: time to first byte is the body's (0.4 s here), not the
    head's (at once), or a TTFT target would never see a slow prefill."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head, now
        await asyncio.sleep(0.4)  # the prefill
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", stream)
    replica = await start(app)
    lb, _, proxy = await make_lb_proxy(
        start, "least_load", [Upstream(1, f"http://127.0.0.1:{replica}", 1)]
    )
    async with aiohttp.ClientSession() as s, s.get(f"{lb}/") as r:
        assert r.status == 200
        assert (await r.read()).count(b"data:") == 3
    totals = proxy.metrics.totals()["1"]
    bounds = list(LATENCY_BUCKETS)
    assert totals.first_byte[bounds.index(0.25)] == 0  # the head's ~0 s would count here
    assert totals.first_byte[-1] == 1


async def test_a_response_cut_short_is_not_passed_off_as_complete(start: Start) -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(half, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{port}", 1)])
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.get(f"{lb}/") as r:
                    await r.read()
    finally:
        server.close()


async def test_pipelined_requests_are_answered_in_order(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)])
    host, port = lb.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /two HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /three HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    paths = []
    for _ in range(3):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        paths.append(json.loads(await reader.readexactly(length))["path"])
    writer.close()
    assert paths == ["/one", "/two", "/three"]


async def test_in_flight_counts_return_to_zero_on_every_exit_path(start: Start) -> None:
    """least_load's counts: success, replica error, refused connection, client disconnect,
    and a replica removed from the set while its requests run."""
    a = await start(upstream_app("a"))
    lb, replicas = await make_lb(
        start,
        "least_load",
        [
            Upstream(1, f"http://127.0.0.1:{a}", 1),
            Upstream(2, f"http://127.0.0.1:{closed_port()}", 1),
        ],
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{lb}/ok") as r:  # success (after a refused connection, maybe)
            assert r.status == 200
        slow = asyncio.create_task(s.get(f"{lb}/slow"))
        await asyncio.sleep(0.2)
        assert replicas.inflight == {1: 1}
        replicas.replace([])  # removed while its request runs: the count stays until it ends
        assert replicas.inflight == {1: 1}
        slow.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        for _ in range(50):
            if not replicas.inflight:
                break
            await asyncio.sleep(0.05)
        assert replicas.inflight == {}
        async with s.get(f"{lb}/none") as r:  # nothing routable: a 503, nothing counted
            assert r.status == 503
    assert replicas.inflight == {}


async def test_cache_aware_counts_prompt_blocks_until_their_first_byte(start: Start) -> None:
    """cache_aware's cost choice weighs the prompt blocks each replica still has to prefill:
    the load balancer counts a request's blocks on its replica from the send to the answer's
    first body byte (not its head), and drops them when an attempt ends without one."""
    release = asyncio.Event()
    heads = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal heads
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head at once
        heads += 1
        await release.wait()  # the prefill
        await resp.write(b"data: token\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    replica = await start(app)
    server, dropped = await start_dropper()
    bad = server.sockets[0].getsockname()[1]
    lb, replicas, proxy = await make_lb_proxy(
        start,
        "cache_aware",
        [Upstream(1, f"http://127.0.0.1:{replica}", 1)],
        workers=1,
    )

    def gauge() -> str:
        from prometheus_client import generate_latest

        proxy.metrics.sync_inflight(replicas.inflight, set(replicas.upstreams))
        text = generate_latest(proxy.metrics.registry).decode()
        return "\n".join(
            line.split("{")[1]
            for line in text.splitlines()
            if line.startswith("fleetserve_lb_replica_queued_prompt_blocks{")
        )

    async def heads_past(seen: int) -> None:
        """Until the replica sent the head of one more answer (2 s at most)."""
        for _ in range(200):
            if heads > seen:
                return
            await asyncio.sleep(0.01)

    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "hello there " * 200}],
    }
    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(f"{lb}/v1/chat/completions", json=body))
            await heads_past(0)
            blocks = len("\x1euser\x1f" + "hello there " * 200) // 256
            assert replicas.prefilling == {1: blocks}  # head sent, no token yet: still counted
            assert gauge().endswith(f'replica="1",service="svc"}} {float(blocks)}')
            release.set()
            async with await task as r:
                assert r.status == 200 and await r.read() == b"data: token\n\n"
            assert replicas.prefilling == {}
            # An attempt that ends unanswered drops its count; the retry's is counted anew.
            release.clear()
            replicas.replace(
                [
                    Upstream(2, f"http://127.0.0.1:{bad}", 1),
                    Upstream(1, f"http://127.0.0.1:{replica}", 1),
                ]
            )
            other = {
                "model": "m",
                "stream": True,
                "messages": [{"role": "user", "content": "new words " * 200}],
            }
            seen = heads
            task = asyncio.ensure_future(s.post(f"{lb}/v1/chat/completions", json=other))
            await heads_past(seen)
            assert len(dropped) == 1  # (its first replica: the one that held nothing of it)
            blocks = len("\x1euser\x1f" + "new words " * 200) // 256
            assert replicas.prefilling == {1: blocks}  # the dropped attempt's count is gone
            release.set()
            async with await task as r:
                assert r.status == 200 and await r.read() == b"data: token\n\n"
            assert replicas.prefilling == {}
            # A whole (not streamed) answer's first byte comes after its decoding: not counted.
            release.clear()
            whole = {**other, "stream": False}
            seen = heads
            task = asyncio.ensure_future(s.post(f"{lb}/v1/chat/completions", json=whole))
            await heads_past(seen)
            assert heads > seen and replicas.inflight and replicas.prefilling == {}
            release.set()
            async with await task as r:
                assert r.status == 200 and await r.read() == b"data: token\n\n"
    finally:
        server.close()


async def test_a_policy_hears_of_each_attempt_from_its_send_to_its_first_byte(
    start: Start,
) -> None:
    """TracksSends: the load balancer tells a policy that asks of each attempt of a request
    with a prompt, to the replica it went to: `sending` at its send, `answered` once, at its
    answer's first body byte (not its head), or when the attempt ends without one (dropped
    and retried elsewhere, the client gone). Nothing for a request without a prompt."""
    from fleetserve.policies.cache_aware import CacheAware
    from fleetserve.policies.lb import RequestKey

    events: list[tuple[str, int, bool]] = []

    class Tracker(CacheAware):
        def sending(self, replica: int, key: RequestKey) -> object | None:
            events.append(("sending", replica, key.streams))
            return (replica, key.streams)  # (None: not answered)

        def answered(self, replica: int, key: RequestKey, token: object) -> None:
            assert token == (replica, key.streams)
            events.append(("answered", replica, key.streams))

    prefill = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head at once
        events.append(("head", 0, True))
        await prefill.wait()
        await resp.write(b"data: token\n\n")
        await resp.write_eof()
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models)
    replica = await start(app)
    server, dropped = await start_dropper()
    bad = server.sockets[0].getsockname()[1]
    lb, replicas, _ = await make_lb_proxy(
        start, "cache_aware", [Upstream(7, f"http://127.0.0.1:{replica}", 1)], workers=1
    )
    replicas.selector = Tracker()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 100}]}

    async def until(n: int) -> None:
        for _ in range(300):
            if len(events) >= n:
                return
            await asyncio.sleep(0.01)

    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(
                s.post(f"{lb}/v1/chat/completions", json={**chat, "stream": True})
            )
            await until(2)
            await asyncio.sleep(0.1)
            assert events == [("sending", 7, True), ("head", 0, True)]  # head: not answered
            prefill.set()
            async with await task as r:
                assert r.status == 200 and await r.read() == b"data: token\n\n"
            assert events[2:] == [("answered", 7, True)]
            # A whole answer: the policy hears of it too (it decides what to credit).
            events.clear()
            async with s.post(f"{lb}/v1/chat/completions", json=chat) as r:
                assert r.status == 200
            assert events == [("sending", 7, False), ("head", 0, True), ("answered", 7, False)]
            # Dropped unanswered by 8, retried at 7: each attempt is told and ended.
            events.clear()
            replicas.replace(
                [
                    Upstream(8, f"http://127.0.0.1:{bad}", 1),
                    Upstream(7, f"http://127.0.0.1:{replica}", 1),
                ]
            )
            replicas.selector = Tracker()
            replicas.selector.prefilling[7] = 10_000  # (so that 8 is tried first)
            async with s.post(f"{lb}/v1/chat/completions", json={**chat, "stream": True}) as r:
                assert r.status == 200
            assert len(dropped) == 1
            assert events == [
                ("sending", 8, True),
                ("answered", 8, True),
                ("sending", 7, True),
                ("head", 0, True),
                ("answered", 7, True),
            ]
            # The client goes away before the first token: the attempt ends, answered.
            events.clear()
            replicas.replace([Upstream(7, f"http://127.0.0.1:{replica}", 1)])
            prefill.clear()
            r = await s.post(f"{lb}/v1/chat/completions", json={**chat, "stream": True})
            assert r.status == 200  # (its head)
            r.close()  # the connection with it
            await until(3)
            assert events == [("sending", 7, True), ("head", 0, True), ("answered", 7, True)]
            prefill.set()
            # No prompt to place by: nothing told.
            events.clear()
            async with s.get(f"{lb}/v1/models") as r:
                assert r.status == 200
            async with s.post(f"{lb}/v1/chat/completions", json={"stream": True}) as r:
                assert r.status == 200
            assert [e for e in events if e[0] != "head"] == []
    finally:
        server.close()
