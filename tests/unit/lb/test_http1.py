"""The load balancer's pure HTTP/1 decisions (response heads, Connection options) and the
limits it is built with, table-tested without sockets."""

from __future__ import annotations

import pydantic
import pytest

from fleetserve.lb.build import FD_RESERVE, MIN_CONNECTIONS, connection_limit
from fleetserve.lb.http import Limits, connection_tokens, plain_response_head, response_head
from fleetserve.lb.proxy import DEFAULT_MAX_CONNECTIONS
from fleetserve.spec.models import LoadBalancerOptions

HOP = [
    (b"Connection", b"X-Hop, keep-alive"),
    (b"Keep-Alive", b"timeout=5"),
    (b"X-Hop", b"secret"),
    (b"X-Kept", b"yes"),
]


@pytest.mark.parametrize(
    ("headers", "http10", "keep_alive", "no_body", "lines", "rechunk", "kept"),
    [
        # HTTP/1.1: connection-specific headers and those named go; the framing stays.
        (
            [*HOP, (b"Content-Length", b"2")],
            False,
            True,
            False,
            [b"X-Kept: yes", b"Content-Length: 2"],
            False,
            True,
        ),
        (
            [*HOP, (b"Transfer-Encoding", b"chunked")],
            False,
            True,
            False,
            [b"X-Kept: yes", b"Transfer-Encoding: chunked"],
            True,
            True,
        ),
        # Naming a framing header does not remove it.
        (
            [(b"Connection", b"Content-Length, Transfer-Encoding"), (b"Content-Length", b"2")],
            False,
            True,
            False,
            [b"Content-Length: 2"],
            False,
            True,
        ),
        # HTTP/1.0, keep-alive asked: kept while the length is known.
        (
            [(b"Content-Length", b"2")],
            True,
            True,
            False,
            [b"Content-Length: 2", b"Connection: keep-alive"],
            False,
            True,
        ),
        # HTTP/1.0 and a chunked body: de-chunked, the connection ends the body.
        (
            [*HOP, (b"Transfer-Encoding", b"chunked")],
            True,
            True,
            False,
            [b"X-Kept: yes", b"Connection: close"],
            False,
            False,
        ),
        # HTTP/1.0 and a body that ends with the replica's connection.
        ([], True, True, False, [b"Connection: close"], False, False),
        # HTTP/1.0, no keep-alive asked.
        (
            [(b"Content-Length", b"2")],
            True,
            False,
            False,
            [b"Content-Length: 2", b"Connection: close"],
            False,
            False,
        ),
        # No body (HEAD, 204, 304): its framing headers do not matter.
        (
            [(b"Transfer-Encoding", b"chunked")],
            True,
            True,
            True,
            [b"Connection: keep-alive"],
            False,
            True,
        ),
        (
            [(b"Transfer-Encoding", b"chunked")],
            False,
            True,
            True,
            [b"Transfer-Encoding: chunked"],
            False,
            True,
        ),
        # HTTP/1.1, the connection ends after this answer (the client asked, or the load
        # balancer stops): it says so, whatever the replica said.
        (
            [(b"Content-Length", b"2"), (b"Connection", b"keep-alive")],
            False,
            False,
            False,
            [b"Content-Length: 2", b"Connection: close"],
            False,
            False,
        ),
    ],
)
def test_response_head(
    headers: list[tuple[bytes, bytes]],
    http10: bool,
    keep_alive: bool,
    no_body: bool,
    lines: list[bytes],
    rechunk: bool,
    kept: bool,
) -> None:
    head = response_head(200, b"OK", headers, http10=http10, keep_alive=keep_alive, no_body=no_body)
    assert head.data == b"\r\n".join([b"HTTP/1.1 200 OK", *lines, b"", b""])
    assert (head.rechunk, head.keep_alive) == (rechunk, kept)


def test_an_interim_response_does_not_say_close() -> None:
    head = response_head(100, b"Continue", [], http10=False, keep_alive=False, no_body=True)
    assert head.data == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_connection_tokens_from_every_connection_header() -> None:
    headers = [(b"connection", b"X-A ,  keep-alive"), (b"Host", b"h"), (b"CONNECTION", b"x-b")]
    assert connection_tokens(headers) == {b"x-a", b"keep-alive", b"x-b"}
    assert connection_tokens([(b"Host", b"h")]) == frozenset()


@pytest.mark.parametrize(
    ("data", "plain"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nX-Connection: a\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nConnection: in the body", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nKEEP-ALIVE: timeout=5\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nproxy-connection: close\r\n\r\n", False),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", False),  # interim first
        (b"HTTP/1.1 200 OK\r\nContent-Le", False),  # the head is not whole yet
    ],
)
def test_plain_response_head(data: bytes, plain: bool) -> None:
    assert plain_response_head(data) is plain


@pytest.mark.parametrize(
    ("wanted", "fd_limit", "limit"),
    [
        (None, 1 << 20, DEFAULT_MAX_CONNECTIONS),
        (None, 20_000, (20_000 - FD_RESERVE) // 2),
        (None, 1024, MIN_CONNECTIONS),
        (500, 20_000, 500),
        (50_000, 20_000, (20_000 - FD_RESERVE) // 2),  # never past what the fds allow
    ],
)
def test_connection_limit(wanted: int | None, fd_limit: int, limit: int) -> None:
    assert connection_limit(LoadBalancerOptions(max_connections=wanted), fd_limit) == limit


def test_limits_have_safe_defaults_and_bounds() -> None:
    limits = Limits.of(LoadBalancerOptions())
    assert (limits.header_bytes, limits.header_count, limits.url_bytes) == (65536, 100, 8192)
    assert (limits.pipelined, limits.header_timeout, limits.idle_timeout) == (16, 10.0, 75.0)
    for bad in (
        {"max_header_bytes": 100},
        {"max_header_count": 0},
        {"max_url_bytes": 10},
        {"max_pipelined_requests": 0},
        {"max_connections": 0},
        {"header_timeout_seconds": 0},
        {"idle_timeout_seconds": -1},
    ):
        with pytest.raises(pydantic.ValidationError):
            LoadBalancerOptions(**bad)  # type: ignore[arg-type]
