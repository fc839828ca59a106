"""Load-balancer features on real loopback sockets: affinity policies, WebSocket, API keys,
TLS, holding requests while scaling from zero, timeouts, metrics and the load report."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.build import tls_context
from fleetserve.lb.config import LbConfig
from fleetserve.lb.priority import PriorityHints
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.factory import make_selector
from fleetserve.policies.prompt import prompt_prefix
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import spec_with_lb, tls_files
from tests.unit.lb.test_proxy import Start, make_lb, make_lb_proxy, start, upstream_app

__all__ = ["start"]  # the fixture, re-used


async def two_upstreams(start: Start) -> list[Upstream]:
    a = await start(upstream_app("a"))
    b = await start(upstream_app("b"))
    return [Upstream(1, f"http://127.0.0.1:{a}", 1), Upstream(2, f"http://127.0.0.1:{b}", 1)]


async def test_sticky_sessions_follow_the_header(start: Start) -> None:
    lb, _ = await make_lb(start, "sticky", await two_upstreams(start))
    async with aiohttp.ClientSession() as s:
        by_session: dict[str, set[str]] = {}
        for i in range(40):
            session = f"user-{i % 8}"
            async with s.get(f"{lb}/", headers={"X-Session-Id": session}) as r:
                by_session.setdefault(session, set()).add((await r.json())["replica"])
    assert all(len(v) == 1 for v in by_session.values())  # each session kept its replica
    assert {next(iter(v)) for v in by_session.values()} == {"a", "b"}  # and sessions spread


async def test_sticky_sessions_by_cookie(start: Start) -> None:
    lb, _ = await make_lb(
        start, "sticky", await two_upstreams(start), session_header=None, session_cookie="sid"
    )
    async with aiohttp.ClientSession() as s:
        seen = set()
        for _ in range(6):
            async with s.get(f"{lb}/", cookies={"sid": "abc"}) as r:
                seen.add((await r.json())["replica"])
    assert len(seen) == 1


async def test_prefix_affinity_routes_shared_prompts_together_and_streams_the_body(
    start: Start,
) -> None:
    lb, _ = await make_lb(start, "prefix_affinity", await two_upstreams(start), prefix_chars=32)
    system = "You are a helpful assistant that answers in French. " * 3
    async with aiohttp.ClientSession() as s:
        replicas = set()
        for i in range(10):
            body = {"model": "m", "prompt": system + f"question {i}"}
            async with s.post(f"{lb}/v1/completions", json=body) as r:
                reply = await r.json()
                replicas.add(reply["replica"])
                assert reply["bytes"] == len(json.dumps(body))  # the peeked head was re-attached
        assert len(replicas) == 1
        spread = set()
        for i in range(30):
            async with s.post(f"{lb}/v1/completions", json={"prompt": f"{i} unrelated"}) as r:
                spread.add((await r.json())["replica"])
        assert spread == {"a", "b"}


async def test_cache_aware_keeps_conversations_on_their_replica_and_bodies_whole(
    start: Start,
) -> None:
    lb, replicas = await make_lb(start, "cache_aware", await two_upstreams(start))
    async with aiohttp.ClientSession() as s:
        placed: dict[int, set[str]] = {}
        for turn in range(3):
            for conv in range(7):  # odd: a rotation would move every conversation
                # Each conversation has its own history (a few KiB: past one 16 KiB peek at
                # the last turn) that every turn repeats and extends.
                history = [{"role": "system", "content": f"conversation {conv}. " * 40}]
                for t in range(turn + 1):
                    history.append({"role": "user", "content": f"turn {t} of {conv} " * 300})
                    history.append({"role": "assistant", "content": "an answer " * 50})
                body = {"model": "m", "messages": history[:-1], "stream": False}
                async with s.post(f"{lb}/v1/chat/completions", json=body) as r:
                    reply = await r.json()
                assert reply["bytes"] == len(json.dumps(body))  # the read body went on whole
                placed.setdefault(conv, set()).add(reply["replica"])
        assert all(len(v) == 1 for v in placed.values())  # every turn on the first one's replica
        assert {next(iter(v)) for v in placed.values()} == {"a", "b"}  # conversations spread
        # A body past cache_max_body_bytes (256 KiB) still goes through whole.
        huge = {"prompt": "x" * (600 * 1024)}
        async with s.post(f"{lb}/v1/completions", json=huge) as r:
            assert (await r.json())["bytes"] == len(json.dumps(huge))
        # Not JSON, or GET: least load, no error.
        async with s.post(f"{lb}/v1/completions", data=b"\xff not json") as r:
            assert r.status == 200
        async with s.get(f"{lb}/v1/models") as r:
            assert r.status == 200
    assert len(replicas.upstreams) == 2


@pytest.mark.parametrize("mode", ["uncached", "deadline", None])
async def test_engine_priority_tells_the_replica_how_much_of_the_prompt_it_lacks(
    start: Start, mode: str | None
) -> None:
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        await request.read()
        seen.append({"hints": request.headers.getall("X-Vllm-Priority", [])})
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    a = await start(app)
    lb, _ = await make_lb(
        start, "cache_aware", [Upstream(1, f"http://127.0.0.1:{a}", 1)], engine_priority=mode
    )
    system = "You are a careful assistant; you answer in one short line. " * 20  # ~1,200 chars
    first = {"model": "m", "messages": [{"role": "system", "content": system}], "stream": True}
    longer = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "a question that is new here " * 20},  # ~560 chars
        ],
    }
    fresh = {"model": "m", "prompt": "another prompt that nobody sent before " * 20}
    # Prompts the LB does not read count as lacking all of their body (bytes / 256): a list
    # of prompts (it reads the first), one sent after `Expect: 100-continue` (it places the
    # request before the body comes), a body that is not JSON.
    # (the batch's first prompt is long: the hint must not be that prompt's alone)
    batch = {"model": "m", "prompt": [system, "a second prompt in the batch " * 40]}
    waits = {"model": "m", "prompt": "a prompt sent only once the replica says go on " * 30}
    async with aiohttp.ClientSession() as s:
        for body, headers in (
            (first, {}),
            (first, {}),
            (longer, {}),
            (fresh, {"X-Vllm-Priority": "-5"}),  # a client that would go first
            ({**fresh, "priority": -5}, {}),  # ... or says so in vLLM's body field
            (batch, {}),
            (waits, {"Expect": "100-continue"}),
            (b"x" * 600, {}),
        ):
            before = loop_ms()
            kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with s.post(f"{lb}/v1/chat/completions", headers=headers, **kwargs) as r:
                assert r.status == 200
            seen[-1]["before"], seen[-1]["after"] = before, loop_ms()
    assert all(len(h["hints"]) <= 1 for h in seen)  # never the client's and the LB's
    values = [h["hints"][0] if h["hints"] else None for h in seen]
    if mode is None:  # nothing sent, nothing taken away
        assert values == [None, None, None, "-5", None, None, None, None]
        return
    # The first request lacks all of its blocks (a 256-character block each, the last one
    # partial: not counted), the second none, the third only those of its new message; the
    # client's own header is replaced by the LB's (which vLLM reads before the body's field).
    unread = [len(json.dumps(batch)) // 256, len(json.dumps(waits)) // 256, 600 // 256]
    assert unread[0] >= 4 and unread[1] >= 5
    missing = [4, 0, 2, 3, 0, *unread]
    if mode == "uncached":
        assert values == [str(m) for m in missing]
    else:  # now in ms, plus 20 ms a block lacking
        for hint, blocks in zip(seen, missing, strict=True):
            value = int(hint["hints"][0]) - 20 * blocks
            assert hint["before"] - 1 <= value <= hint["after"] + 1


def test_an_engine_priority_hint_stays_a_64_bit_integer() -> None:
    """A client may claim any Content-Length; the hint it yields never leaves vLLM's range."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"
    for mode, ms in (("uncached", 20.0), ("deadline", 60_000.0)):
        hints = PriorityHints(mode, ms, 256, clock=lambda: 1_765_000_000.5)
        assert hints.head(head, 3, 0, hints.stamp()).endswith(
            b"Host: x\r\nX-Vllm-Priority: %d\r\n\r\n"
            % (3 if mode == "uncached" else 1_765_000_000_500 + 180_000)
        )
        huge = hints.head(head, None, 10**30, hints.stamp())
        assert huge.endswith(b"X-Vllm-Priority: %d\r\n\r\n" % ((1 << 63) - 1))


def test_engine_priority_is_refused_where_it_would_send_nothing() -> None:
    """Another policy has no estimate to send, nor does the nginx data plane: a clear error;
    an unknown mode names the ones there are."""
    from fleetserve.spec.loader import InvalidSpec, parse_spec

    def spec(policy: str, mode: str, plane: str = "python") -> str:
        return spec_with_lb(policy, plane, engine_priority=mode)

    parsed = parse_spec(spec("cache_aware", "deadline"))
    assert parsed.service is not None
    assert parsed.service.load_balancer.engine_priority == "deadline"
    for policy, plane in (("least_load", "python"), ("cache_aware", "nginx")):
        with pytest.raises(InvalidSpec, match="engine_priority sends cache_aware's estimate"):
            parse_spec(spec(policy, "uncached", plane))
    with pytest.raises(InvalidSpec, match="engine_priority") as bad:
        parse_spec(spec("cache_aware", "fifo"))
    assert "uncached" in str(bad.value) and "deadline" in str(bad.value)
    with pytest.raises(InvalidSpec, match="write null to send no hints"):  # YAML's off: False
        parse_spec(spec("cache_aware", "off"))
    parsed = parse_spec(spec("cache_aware", "null"))
    assert parsed.service is not None and parsed.service.load_balancer.engine_priority is None


def loop_ms() -> int:
    return int(time.time() * 1000)


@pytest.mark.parametrize("policy", ["cache_aware", "prefix_affinity"])
async def test_a_body_policy_answers_408_to_a_body_that_does_not_come(
    start: Start, policy: str
) -> None:
    """A policy that reads the body before choosing holds the request meanwhile: a client that
    sends a head and too little of its body gets a 408 (the head's time limit), not a hold."""
    upstreams = await two_upstreams(start)
    lb, _, proxy = await make_lb_proxy(start, policy, upstreams, header_timeout_seconds=0.5)
    port = int(lb.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": "'
    )
    await writer.drain()
    started = asyncio.get_running_loop().time()
    answer = await asyncio.wait_for(reader.read(), 5)  # and the connection is closed
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert b"request_timeout" in answer
    assert asyncio.get_running_loop().time() - started < 2
    writer.close()
    assert all(n == 0 for n in proxy.replicas.inflight.values())
    # The same policy still serves a whole request at once.
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{lb}/v1/completions", json={"prompt": "hi"}) as r,
    ):
        assert r.status == 200


async def test_cache_aware_answers_pipelined_and_chunked_requests_in_order(start: Start) -> None:
    """Requests that arrive whole behind another (pipelined) and chunked bodies: each chosen
    once its body is here, answered in order, bodies intact."""
    lb, _ = await make_lb(start, "cache_aware", await two_upstreams(start))
    port = int(lb.rsplit(":", 1)[1])
    bodies = [json.dumps({"prompt": f"request {i} " * (50 + i)}).encode() for i in range(3)]
    wire = b"".join(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    )
    chunked = b'{"prompt": "in two chunks"}'
    wire += (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (10, chunked[:10], len(chunked) - 10, chunked[10:])
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    sizes = [int(m) for m in re.findall(rb'"bytes": (\d+)', answer)]
    assert answer.count(b"HTTP/1.1 200 ") == 4
    assert sizes == [*(len(b) for b in bodies), len(chunked)]


async def test_a_body_policy_waits_for_a_slow_but_steady_body_and_counts_leavers(
    start: Start,
) -> None:
    """The body's time limit is a limit on silence: a body that keeps coming, slower than the
    head's time limit in all, goes through; so does one pipelined behind a slow request. A
    client that leaves before its body is complete counts as a 499."""
    upstreams = await two_upstreams(start)
    lb, _, proxy = await make_lb_proxy(start, "cache_aware", upstreams, header_timeout_seconds=0.5)
    port = int(lb.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "slow " * 100}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    for i in range(0, len(body), 100):  # ~1.2 s in all, never 0.5 s silent
        writer.write(body[i : i + 100])
        await writer.drain()
        await asyncio.sleep(0.2)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 200 "), head
    writer.close()
    # A client that sends half a body and leaves: 499, nothing left in flight.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    labels = {"service": "svc", "policy": "cache_aware", "replica": "none", "code": "499"}
    for _ in range(100):
        await asyncio.sleep(0.02)
        if proxy.metrics.registry.get_sample_value("fleetserve_lb_requests_total", labels):
            break
    assert proxy.metrics.registry.get_sample_value("fleetserve_lb_requests_total", labels) == 1
    assert all(n == 0 for n in proxy.replicas.inflight.values())


@pytest.mark.parametrize("policy", ["cache_aware", "prefix_affinity"])
async def test_a_body_policy_lets_a_client_wait_for_100_continue(start: Start, policy: str) -> None:
    """A client that sends `Expect: 100-continue` holds its body until told to go on: a body
    policy must not wait for that body (it is chosen by load; the replica says 100)."""
    lb, _ = await make_lb(start, policy, await two_upstreams(start))
    port = int(lb.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"prompt": "hello there"}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    await writer.drain()
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert interim.startswith(b"HTTP/1.1 100 ")
    writer.write(body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.close()


def test_prompt_prefix_extraction() -> None:
    assert prompt_prefix(b'{"prompt": "hello world"}', 5) == "hello"
    chat = b'{"messages": [{"role": "user", "content": "caf\\u00e9 au lait"}]}'
    assert prompt_prefix(chat, 4) == "café"
    assert prompt_prefix(b'{"nothing": 1}', 5) is None


async def test_websocket_echo_passes_through(start: Start) -> None:
    async def ws_echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=("echo",))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data[::-1])
        return ws

    app = web.Application()
    app.router.add_get("/ws", ws_echo)
    port = await start(app)
    lb, _ = await make_lb(start, "least_load", [Upstream(1, f"http://127.0.0.1:{port}", 1)])
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{lb}/ws", protocols=("echo",)) as ws:
        assert ws.protocol == "echo"
        await ws.send_str("hi")
        assert (await ws.receive(timeout=5)).data == "echo:hi"
        await ws.send_bytes(b"abc")
        assert (await ws.receive(timeout=5)).data == b"cba"


async def test_api_keys_are_required_and_not_forwarded(start: Start) -> None:
    seen: list[dict[str, Any]] = []
    a = await start(upstream_app("a", seen))
    key = "k" * 32
    lb, _ = await make_lb(
        start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)], api_keys=[key]
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{lb}/") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        async with s.get(f"{lb}/", headers={"Authorization": "Bearer " + "x" * 32}) as r:
            assert r.status == 401
        async with s.get(f"{lb}/", headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
    assert len(seen) == 1 and "Authorization" not in seen[0]["headers"]


async def test_tls_at_the_load_balancer(start: Start, tmp_path: Path) -> None:
    ca, certfile, keyfile = tls_files(tmp_path)
    a = await start(upstream_app("a"))
    cfg = LbConfig(
        service="svc", port=0, admin_port=0, tls_certfile=str(certfile), tls_keyfile=str(keyfile)
    )
    replicas = ReplicaSet(make_selector("least_load"))
    replicas.replace([Upstream(1, f"http://127.0.0.1:{a}", 1)])
    proxy = Proxy(cfg, replicas)
    await proxy.serve("127.0.0.1", 0, tls_context(cfg))
    port = proxy.port
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"https://localhost:{port}/", ssl=client_ctx) as r:
                assert (await r.json())["replica"] == "a"
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"http://localhost:{port}/") as r:
                    await r.read()
    finally:
        await proxy.close()


async def test_held_requests_are_forwarded_once_a_replica_is_ready(start: Start) -> None:
    woken = asyncio.Event()

    async def wake() -> None:
        woken.set()

    replicas = ReplicaSet(make_selector("least_load"))
    cfg = LbConfig(
        service="svc",
        port=0,
        admin_port=0,
        hold_when_empty=True,
        options=LoadBalancerOptions(queue_size=5, queue_timeout_seconds=10),
    )
    port = await start(Proxy(cfg, replicas, wake=wake))
    a = await start(upstream_app("a"))
    async with aiohttp.ClientSession() as s:
        pending = [asyncio.create_task(s.get(f"http://127.0.0.1:{port}/held")) for _ in range(3)]
        await asyncio.wait_for(woken.wait(), 5)  # the controller is told at once
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in pending)  # held, not answered with 503
        replicas.replace([Upstream(1, f"http://127.0.0.1:{a}", 1)])
        for t in pending:
            r = await asyncio.wait_for(t, 5)
            assert r.status == 200 and (await r.json())["replica"] == "a"


async def test_holding_is_bounded_in_time_and_queue(start: Start) -> None:
    lb, _, proxy = await make_lb_proxy(
        start, "least_load", [], hold_when_empty=True, queue_size=2, queue_timeout_seconds=0.5
    )
    async with aiohttp.ClientSession() as s:
        waiting = [asyncio.create_task(s.get(f"{lb}/")) for _ in range(2)]
        await asyncio.sleep(0.2)
        async with s.get(f"{lb}/") as r:
            assert r.status == 503 and (await r.json())["error"] == "queue_full"
        for t in waiting:
            r = await t
            assert r.status == 503 and "within 0.5 s" in (await r.json())["message"]
    assert proxy.queued == 0


async def test_a_silent_replica_times_out_with_504(start: Start) -> None:
    a = await start(upstream_app("a"))
    lb, _ = await make_lb(
        start, "least_load", [Upstream(1, f"http://127.0.0.1:{a}", 1)], read_timeout_seconds=0.3
    )
    async with aiohttp.ClientSession() as s, s.get(f"{lb}/slow") as r:
        assert r.status == 504
        assert "within 0.3 s" in (await r.json())["message"]


async def test_metrics_and_load_report(start: Start) -> None:
    ups = await two_upstreams(start)
    lb, replicas, proxy = await make_lb_proxy(start, "round_robin", ups)
    admin = await start(make_admin_app(proxy))
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.get(f"{lb}/") as r:
                assert r.status == 200
        async with s.get(f"http://127.0.0.1:{admin}/metrics") as r:
            text = await r.text()
        async with s.get(f"http://127.0.0.1:{admin}/-/load") as r:
            load = await r.json()
    assert (
        'fleetserve_lb_requests_total{code="200",policy="round_robin",'
        'replica="1",service="svc"} 3.0' in text
    )
    assert "fleetserve_lb_request_duration_seconds_bucket" in text
    assert (
        'fleetserve_lb_inflight_requests{policy="round_robin",replica="2",service="svc"} 0.0'
        in text
    )
    assert load["total_requests"] == 6
    assert load["replicas"]["1"]["requests_per_second"] == pytest.approx(3 / 60)
    assert replicas.inflight == {}
