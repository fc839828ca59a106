"""The data plane: a streaming reverse proxy on aiohttp.

Request and response bodies are streamed both ways (never buffered whole). A request is retried
on another replica only when the connection failed before the request was sent, so a request a
replica may have started to process is never sent twice.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from fleetserve.lb.replica_set import ReplicaSet, Upstream

log = logging.getLogger("fleetserve.lb")

# RFC 9110 7.6.1: connection-specific headers are not forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in HOP_BY_HOP or lk == "host":
            continue
        headers.add(k, v)
    peer = request.remote or ""
    prior = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers["X-Forwarded-Proto"] = request.scheme
    if request.host:
        headers["X-Forwarded-Host"] = request.host
    return headers


def _response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream.headers.items():
        if k.lower() not in HOP_BY_HOP:
            headers.add(k, v)
    return headers


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


class Proxy:
    def __init__(
        self,
        service: str,
        replicas: ReplicaSet,
        connect_timeout: float = 5.0,
        max_attempts: int = 3,
    ) -> None:
        self.service = service
        self.replicas = replicas
        self.connect_timeout = connect_timeout
        self.max_attempts = max_attempts
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None, "Proxy.start() was not awaited"
        has_body = request.body_exists
        headers = _forward_headers(request)
        tried: set[int] = set()
        failures: list[str] = []
        for _ in range(self.max_attempts):
            upstream = self.replicas.pick(frozenset(tried))
            if upstream is None:
                break
            tried.add(upstream.replica_id)
            with self.replicas.track(upstream.replica_id):
                try:
                    resp = await self._session.request(
                        request.method,
                        upstream.url + request.rel_url.raw_path_qs,
                        headers=headers,
                        data=request.content if has_body else None,
                        allow_redirects=False,
                    )
                except aiohttp.ClientConnectorError as e:
                    # Nothing was sent: safe to try another replica.
                    self.replicas.discard(upstream.replica_id)
                    failures.append(f"replica {upstream.replica_id}: {e.os_error or e}")
                    log.warning("replica %s refused a connection: %s", upstream.replica_id, e)
                    continue
                except aiohttp.ServerDisconnectedError as e:
                    if has_body:
                        return _error(502, "upstream_disconnected", self._said(upstream, e))
                    # A bodiless request on a stale pooled connection: nothing was answered.
                    failures.append(f"replica {upstream.replica_id}: {e}")
                    continue
                except aiohttp.ClientError as e:
                    return _error(502, "upstream_error", self._said(upstream, e))
                return await self._relay(request, resp)
        if not tried:
            return _error(
                503,
                "no_ready_replicas",
                f"service {self.service!r} has no READY replica; "
                f"see `fleetserve status {self.service}`",
            )
        return _error(
            502, "upstream_unreachable", "no replica could be reached: " + "; ".join(failures)
        )

    def _said(self, upstream: Upstream, e: Exception) -> str:
        return f"replica {upstream.replica_id} failed mid-request: {type(e).__name__}: {e}"

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        async with resp:
            out = web.StreamResponse(status=resp.status, reason=resp.reason)
            out.headers.extend(_response_headers(resp))
            if resp.headers.get("Content-Length") is None and request.method != "HEAD":
                out.enable_chunked_encoding()
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
                # The replica died mid-response: close the client's connection so that it sees
                # a truncated response rather than a complete-looking one.
                log.warning("replica response cut short: %s", e)
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out


def make_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=0)

    async def _handle(request: web.Request) -> web.StreamResponse:
        return await proxy.handle(request)

    async def _on_startup(_app: Any) -> None:
        await proxy.start()

    async def _on_cleanup(_app: Any) -> None:
        await proxy.close()

    app.router.add_route("*", "/{tail:.*}", _handle)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app
