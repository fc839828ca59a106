"""The load balancer's pure HTTP/1.1 helpers: client limits, error responses, the headers
that are connection-specific, response heads made fit for a client."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from http import HTTPStatus

from fleetserve.spec.models import LoadBalancerOptions

# RFC 9110 7.6.1: connection-specific headers are not forwarded. `upgrade` is, with
# `Connection: upgrade`, when the client asks for one.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
    }
)
# Headers a `Connection:` header may not make hop-by-hop: dropping one would change where the
# message ends for the replica (request smuggling), or leave it without a Host.
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"host"})
# A response's connection-specific headers (the replica's keep-alive is not the client's).
RESPONSE_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
# The write-buffer high-water mark of both sides' sockets (flow control), and how much of a
# request body is buffered while no replica is attached.
HIGH_WATER = 256 * 1024
MIN_HEAD_BYTES = 16  # no request head is shorter ("GET / HTTP/1.0\r\n\r\n" is 18 bytes)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client connection may make the load balancer hold (from LoadBalancerOptions)."""

    header_bytes: int  # the header lines of one request
    header_count: int
    url_bytes: int
    pipelined: int  # requests queued on one connection
    header_timeout: float  # from a head's first byte to its end (and a new connection's first)
    idle_timeout: float  # a keep-alive connection with nothing to do
    head_bytes: int  # the most bytes a head in progress may span (request line, headers, CRLFs)
    small_read: int  # a read shorter than this cannot hold more heads than an empty queue takes

    @classmethod
    def of(cls, opts: LoadBalancerOptions) -> Limits:
        return cls(
            header_bytes=opts.max_header_bytes,
            header_count=opts.max_header_count,
            url_bytes=opts.max_url_bytes,
            pipelined=opts.max_pipelined_requests,
            header_timeout=opts.header_timeout_seconds,
            idle_timeout=opts.idle_timeout_seconds,
            head_bytes=opts.max_header_bytes + opts.max_url_bytes + 4096,
            small_read=(opts.max_pipelined_requests - 1) * MIN_HEAD_BYTES,
        )


def error_response(
    status: int, code: str, message: str, close: bool = False, extra: dict[str, str] | None = None
) -> bytes:
    body = json.dumps({"error": code, "message": message}).encode() + b"\n"
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close" if close else "Connection: keep-alive",
        *(f"{k}: {v}" for k, v in (extra or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The options of every `Connection:` header, lowercased (RFC 9110 7.6.1)."""
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    )


# The first connection-specific header of a response head, or its end (group 1 empty).
RESPONSE_HOP_PATTERN = re.compile(rb"\r\n(?:(connection|keep-alive|proxy-connection):|\r\n)", re.I)


def plain_response_head(data: bytes) -> bool:
    """Whether a response's first bytes hold its whole head, a final one (not 1xx), with no
    connection-specific header: such a response passes through untouched (the fast path)."""
    if data[9:10] == b"1":
        return False
    m = RESPONSE_HOP_PATTERN.search(data)
    return m is not None and m.group(1) is None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    data: bytes  # the head as it goes to the client
    rechunk: bool  # the body's pieces are framed as chunks again (the parser removed them)
    keep_alive: bool  # False: the client connection closes after this response


def response_head(
    status: int,
    reason: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    http10: bool,
    keep_alive: bool,
    no_body: bool,
) -> ResponseHead:
    """A replica's response head made fit for the client: connection-specific headers (and
    those its `Connection:` names) removed; for an HTTP/1.0 client no chunked framing (the
    body is de-chunked and ends with the connection) and its own keep-alive answer."""
    drop = RESPONSE_HOP_BY_HOP | (connection_tokens(headers) - FRAMING)
    names = {name.lower() for name, _ in headers}
    chunked = b"transfer-encoding" in names
    out = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in headers:
        ln = name.lower()
        if ln in drop or (http10 and ln == b"transfer-encoding"):
            continue
        out += (name, b": ", value, b"\r\n")
    if http10:
        # Without chunked framing, a body of unknown length ends when the connection does.
        keep_alive = keep_alive and (no_body or (b"content-length" in names and not chunked))
        out.append(b"Connection: keep-alive\r\n" if keep_alive else b"Connection: close\r\n")
    elif not keep_alive and status >= 200:
        # The connection ends after this answer (the client asked, or the load balancer is
        # stopping): say so (RFC 9112 9.6), or the client may send its next request on it.
        out.append(b"Connection: close\r\n")
    out.append(b"\r\n")
    return ResponseHead(b"".join(out), chunked and not http10 and not no_body, keep_alive)
