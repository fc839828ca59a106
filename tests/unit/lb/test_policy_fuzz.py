"""Hostile JSON bodies against the body policies, through real sockets: every request gets
the replica's answer, no connection or file descriptor is left behind, and nothing a client
sends makes the LB log a traceback.

An outside attack found that lone surrogates ("\\ud800") in a chat message killed the
transport of a cache_aware LB (a UnicodeEncodeError from hashing), with no answer and a socket
left in CLOSE-WAIT for good."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from fleetserve.core.clock import FakeClock
from tests.unit.lb import test_proxy
from tests.unit.lb.test_features import two_upstreams
from tests.unit.lb.test_proxy import Start, make_lb_proxy

start = test_proxy.start  # the fixture: real sockets on loopback

SURROGATES = "\\ud800" * 260
HOSTILE: list[bytes] = [
    b'{"messages":[{"role":"user","content":"' + SURROGATES.encode() + b'"}]}',
    b'{"messages":[{"role":"' + SURROGATES.encode() + b'","content":"x"}]}',
    b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff\\ud800"}]}]}',
    b'{"prompt":"' + SURROGATES.encode() * 4 + b'"}',
    b'{"prompt":["\\ud83d' + b"a" * 600 + b'"]}',
    b'{"input":"\\udc80' + b"b" * 600 + b'"}',
    b'{"prompt": NaN}',
    b'{"messages": Infinity}',
    b'{"prompt": 1e999999}',
    b'{"prompt": ' + b"9" * 5000 + b"}",  # past Python's int digits limit
    b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}",  # past the recursion limit
    b'{"messages": "not a list"}',
    b'{"messages": [1, 2.5, null, true, "x", []]}',
    b'{"messages": [{"role": ["a"], "content": {"text": "x"}}]}',
    b'{"messages": [{"content": [1, {"text": 2}, {"type": "text"}]}]}',
    b'{"prompt": [{"a": 1}]}',
    b'{"prompt": []}',
    b"[]",
    b"null",
    b'"\\ud800"',
    b"\xff\xfe not utf-8 \xed\xa0\x80",
    b'{"messages":[{"role":"user","content":"\xed\xa0\x80 raw surrogate bytes"}]}',
    b"",
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def post_in_two_sends(port: int, body: bytes) -> bytes:
    """A POST whose head and body go in separate sends (the shape that crashed the LB); the
    response's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(body)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("policy", ["cache_aware", "prefix_affinity"])
async def test_hostile_json_bodies_are_routed_and_leak_nothing(
    start: Start, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    upstreams = await two_upstreams(start)
    lb, replicas, proxy = await make_lb_proxy(start, policy, upstreams)
    port = int(lb.rsplit(":", 1)[1])
    await post_in_two_sends(port, b'{"prompt": "warm"}')  # pools and lazy state made
    fds = open_fds()
    caplog.set_level(logging.WARNING)
    for round_ in range(3):
        for body in HOSTILE:
            status = await post_in_two_sends(port, body)
            assert status.startswith(b"HTTP/1.1 200"), (round_, body[:80], status)
    await asyncio.sleep(0.2)
    assert not proxy.clients  # every client connection closed
    assert open_fds() <= fds + 2  # (a pooled replica connection or two may be open)
    assert replicas.policy_errors == 0
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]


async def test_a_failing_policy_never_fails_the_request(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy that raises (a bug some input reaches) is contained: the request goes by
    least load, the failure is counted and logged once, the connection is answered."""
    upstreams = await two_upstreams(start)
    clock = FakeClock()
    lb, replicas, proxy = await make_lb_proxy(start, "cache_aware", upstreams, clock=clock)
    port = int(lb.rsplit(":", 1)[1])

    def broken(*_args: object, **_kwargs: object) -> int | None:
        raise RuntimeError("a policy bug")

    replicas.selector.select = broken  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR)
    for _ in range(5):
        status = await post_in_two_sends(port, b'{"prompt": "' + b"p" * 600 + b'"}')
        assert status.startswith(b"HTTP/1.1 200"), status
    assert replicas.policy_errors == 5
    logged = [r for r in caplog.records if "policy failed" in r.getMessage()]
    assert len(logged) == 1  # once a minute, not once a request

    async def advance(seconds: float) -> None:
        """Move the fake clock, and let the proxy's sweep see it before the next request
        (a connection stamped with the sweep's older time would look a minute late)."""
        clock.advance(seconds)
        for _ in range(300):
            if proxy.clock >= clock.monotonic():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the proxy's sweep did not run")

    await advance(59)
    await post_in_two_sends(port, b'{"prompt": "p"}')
    await advance(1)  # a minute since the first: logged again
    await post_in_two_sends(port, b'{"prompt": "p"}')
    assert replicas.policy_errors == 7
    logged = [r for r in caplog.records if "policy failed" in r.getMessage()]
    assert len(logged) == 2
