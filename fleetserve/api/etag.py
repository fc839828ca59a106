"""ETags on the API's JSON reads: a client that polls (the dashboard, every two seconds)
sends back the tag it holds and gets an empty 304 while nothing changed.

Only complete JSON answers to GET are tagged; streams (logs, followed or not) pass through
untouched, never buffered."""

from __future__ import annotations

import hashlib

from fleetserve.api.auth import ASGIApp, Message, Receive, Scope, Send


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _matches(if_none_match: bytes | None, tag: bytes) -> bool:
    if if_none_match is None:
        return False
    given = [t.strip().removeprefix(b"W/") for t in if_none_match.split(b",")]
    return tag in given or b"*" in given


class ETags:
    def __init__(self, app: ASGIApp, max_bytes: int = 8 * 1024 * 1024) -> None:
        self.app = app
        self.max_bytes = max_bytes  # a larger answer goes out untagged, as it comes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        if_none_match = _header(scope.get("headers", []), b"if-none-match")
        start: Message | None = None
        chunks: list[bytes] = []
        size = 0
        passing = False

        async def buffered(message: Message) -> None:
            nonlocal start, size, passing
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start":
                ctype = _header(message.get("headers", []), b"content-type") or b""
                if message["status"] != 200 or not ctype.startswith(b"application/json"):
                    passing = True
                    await send(message)
                    return
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                passing = True
                await send(start)
                await send(
                    {"type": "http.response.body", "body": b"".join(chunks), "more_body": more}
                )
                return
            if more:
                return
            body = b"".join(chunks)
            tag = b'"' + hashlib.blake2b(body, digest_size=16).hexdigest().encode() + b'"'
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"etag", tag))
            headers.append((b"cache-control", b"no-cache"))
            if _matches(if_none_match, tag):
                await send({"type": "http.response.start", "status": 304, "headers": headers})
                await send({"type": "http.response.body", "body": b""})
                return
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, buffered)
