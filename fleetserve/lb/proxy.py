"""The data plane: a streaming reverse proxy on aiohttp.

Request and response bodies are streamed both ways (never buffered whole). A request is retried
on another replica only when the connection failed before the request was sent, so a request a
replica may have started to process is never sent twice. WebSocket upgrades are passed through.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from fleetserve.lb.config import LbConfig
from fleetserve.lb.metrics import LoadTracker, Metrics
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.lb import NO_KEY, RequestKey

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
WS_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-accept",
    }
)
_PROMPT = re.compile(rb'"(?:prompt|content|input)"\s*:\s*"((?:[^"\\]|\\.){1,4096})')
PEEK_BYTES = 16 * 1024


def _forward_headers(request: web.Request, strip_auth: bool) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in HOP_BY_HOP or lk == "host" or (strip_auth and lk == "authorization"):
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


def _error(status: int, code: str, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status, headers=headers)


def prompt_prefix(head: bytes, chars: int) -> str | None:
    """The first `chars` characters of the prompt in a JSON body's head (OpenAI-style
    `prompt`, the first message's `content`, or `input`), or None."""
    m = _PROMPT.search(head)
    if m is None:
        return None
    try:
        text = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        text = m.group(1).decode(errors="replace")
    return str(text)[:chars] or None


class Proxy:
    def __init__(
        self,
        config: LbConfig,
        replicas: ReplicaSet,
        metrics: Metrics | None = None,
        load: LoadTracker | None = None,
        wake: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.config = config
        self.opts = config.options
        self.replicas = replicas
        self.metrics = metrics or Metrics(config.service, config.policy)
        self.load = load or LoadTracker()
        self.wake = wake
        self.queued = 0
        self._wake_task: asyncio.Task[None] | None = None
        self._keys = [k.encode() for k in self.opts.api_keys]
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.opts.connect_timeout_seconds,
                sock_read=self.opts.read_timeout_seconds,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- the request path ------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self._keys:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        return any(hmac.compare_digest(given, key) for key in self._keys)

    async def _key_and_body(
        self, request: web.Request
    ) -> tuple[RequestKey, AsyncIterator[bytes] | aiohttp.StreamReader | None]:
        """The request's affinity key and the body to forward (its head re-attached)."""
        body: AsyncIterator[bytes] | aiohttp.StreamReader | None = (
            request.content if request.body_exists else None
        )
        policy = self.config.policy
        if policy == "sticky":
            session = None
            if self.opts.session_header:
                session = request.headers.get(self.opts.session_header)
            if session is None and self.opts.session_cookie:
                session = request.cookies.get(self.opts.session_cookie)
            return RequestKey(session=session), body
        if policy == "prefix_affinity" and request.body_exists:
            head = b""
            while len(head) < PEEK_BYTES:
                chunk = await request.content.read(PEEK_BYTES - len(head))
                if not chunk:
                    break
                head += chunk
            rest = request.content

            async def chained() -> AsyncIterator[bytes]:
                if head:
                    yield head
                async for chunk in rest.iter_any():
                    yield chunk

            return RequestKey(prefix=prompt_prefix(head, self.opts.prefix_chars)), chained()
        return NO_KEY, body

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        if not self._authorized(request):
            resp = _error(
                401,
                "unauthorized",
                "a valid API key is required: Authorization: Bearer <key>",
                **{"WWW-Authenticate": "Bearer"},
            )
            self.metrics.done("none", 401, time.monotonic() - started)
            return resp
        if not self.replicas.upstreams and self.config.hold_when_empty:
            held = await self._hold()
            if held is not None:
                self.metrics.done("none", held.status, time.monotonic() - started)
                self.load.record("none")
                return held
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request)
        key, body = await self._key_and_body(request)
        headers = _forward_headers(request, strip_auth=bool(self._keys))
        tried: set[int] = set()
        failures: list[str] = []
        for _ in range(self.opts.max_attempts):
            upstream = self.replicas.pick(frozenset(tried), key)
            if upstream is None:
                break
            tried.add(upstream.replica_id)
            rid = str(upstream.replica_id)
            self.load.record(rid)
            with self.replicas.track(upstream.replica_id):
                try:
                    answered, code = await self._forward(request, upstream, headers, body)
                except _Retry as e:
                    failures.append(f"replica {rid}: {e}")
                    continue
            self.metrics.done(rid, code, time.monotonic() - started)
            return answered
        if not tried:
            self.load.record("none")
            resp = _error(
                503,
                "no_ready_replicas",
                f"service {self.config.service!r} has no READY replica; "
                f"see `fleetserve status {self.config.service}`",
            )
        else:
            resp = _error(
                502, "upstream_unreachable", "no replica could be reached: " + "; ".join(failures)
            )
        self.metrics.done("none", resp.status, time.monotonic() - started)
        return resp

    async def _hold(self) -> web.Response | None:
        """No replica is ready and the service scales from zero: wait for one (bounded)."""
        if self.queued >= self.opts.queue_size:
            return _error(
                503,
                "queue_full",
                f"service {self.config.service!r} is starting from zero and "
                f"{self.queued} requests are already waiting; retry later",
                **{"Retry-After": "5"},
            )
        self.queued += 1
        self.metrics.set_queued(self.queued)
        try:
            if self.wake is not None:
                self._wake_task = asyncio.get_running_loop().create_task(self.wake())
            if await self.replicas.wait_ready(self.opts.queue_timeout_seconds):
                return None
        finally:
            self.queued -= 1
            self.metrics.set_queued(self.queued)
        return _error(
            503,
            "no_ready_replicas",
            f"service {self.config.service!r} had no READY replica within "
            f"{self.opts.queue_timeout_seconds:g} s",
            **{"Retry-After": "5"},
        )

    async def _forward(
        self,
        request: web.Request,
        upstream: Upstream,
        headers: CIMultiDict[str],
        body: AsyncIterator[bytes] | aiohttp.StreamReader | None,
    ) -> tuple[web.StreamResponse, int]:
        assert self._session is not None, "Proxy.start() was not awaited"
        rid = str(upstream.replica_id)
        try:
            resp = await self._session.request(
                request.method,
                upstream.url + request.rel_url.raw_path_qs,
                headers=headers,
                data=body,
                allow_redirects=False,
            )
        except aiohttp.ClientConnectorError as e:
            # Nothing was sent: safe to try another replica; stop routing to this one.
            self.replicas.discard(upstream.replica_id)
            self.metrics.error(rid, "connect")
            log.warning("replica %s refused a connection: %s", rid, e.os_error or e)
            raise _Retry(str(e.os_error or e)) from None
        except aiohttp.ServerDisconnectedError as e:
            self.metrics.error(rid, "disconnected")
            if body is None:
                # A bodiless request on a stale pooled connection: nothing was answered.
                raise _Retry(str(e)) from None
            return _error(502, "upstream_disconnected", self._said(upstream, e)), 502
        except TimeoutError:
            self.metrics.error(rid, "timeout")
            return _error(
                504,
                "upstream_timeout",
                f"replica {rid} sent no response within {self.opts.read_timeout_seconds:g} s",
            ), 504
        except aiohttp.ClientError as e:
            self.metrics.error(rid, "other")
            return _error(502, "upstream_error", self._said(upstream, e)), 502
        return await self._relay(request, resp, rid), resp.status

    def _said(self, upstream: Upstream, e: Exception) -> str:
        return f"replica {upstream.replica_id} failed mid-request: {type(e).__name__}: {e}"

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, rid: str
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
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as e:
                # The replica died or stalled mid-response: close the client's connection so
                # that it sees a truncated response rather than a complete-looking one.
                self.metrics.error(rid, "mid_response")
                log.warning("replica %s response cut short: %s", rid, e)
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {
            k: v
            for k, v in _forward_headers(request, strip_auth=bool(self._keys)).items()
            if k.lower() not in WS_HANDSHAKE and k.lower() != "sec-websocket-protocol"
        }
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        ]
        tried: set[int] = set()
        for _ in range(self.opts.max_attempts):
            upstream = self.replicas.pick(frozenset(tried))
            if upstream is None:
                break
            tried.add(upstream.replica_id)
            url = upstream.url.replace("http", "ws", 1) + request.rel_url.raw_path_qs
            try:
                upstream_ws = await self._session.ws_connect(
                    url, headers=headers, protocols=protocols, autoping=False
                )
            except aiohttp.ClientConnectorError:
                self.replicas.discard(upstream.replica_id)
                self.metrics.error(str(upstream.replica_id), "connect")
                continue
            except aiohttp.WSServerHandshakeError as e:
                return _error(502, "websocket_refused", f"replica refused the upgrade: {e.status}")
            with self.replicas.track(upstream.replica_id):
                return await self._pump(request, upstream_ws)
        return _error(
            503, "no_ready_replicas", f"service {self.config.service!r} has no READY replica"
        )

    async def _pump(
        self, request: web.Request, upstream_ws: aiohttp.ClientWebSocketResponse
    ) -> web.StreamResponse:
        client_ws = web.WebSocketResponse(
            protocols=[upstream_ws.protocol] if upstream_ws.protocol else (), autoping=False
        )
        await client_ws.prepare(request)

        async def copy(src: Any, dst: Any) -> None:
            async for msg in src:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                elif msg.type == aiohttp.WSMsgType.PING:
                    await dst.ping(msg.data)
                elif msg.type == aiohttp.WSMsgType.PONG:
                    await dst.pong(msg.data)
                else:
                    break
            await dst.close()

        async with upstream_ws:
            await asyncio.gather(
                copy(client_ws, upstream_ws), copy(upstream_ws, client_ws), return_exceptions=True
            )
        return client_ws


class _Retry(Exception):
    """The request was not sent: another replica may take it."""


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
