"""The load balancer's admin API (loopback only): the controller pushes the replica set here
and reads the load report; Prometheus scrapes /metrics."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from fleetserve.lb.messages import LoadReport, ReplicaPush
from fleetserve.lb.metrics import load_report
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.workers import MergedMetrics, merge_load

log = logging.getLogger("fleetserve.lb")


class Relay(Protocol):
    """Who else must hear of a push, and whose reports add to this process's: the other
    workers (Supervisor), or the nginx data plane."""

    async def push(self, push: ReplicaPush) -> None: ...

    async def reports(self) -> list[dict[str, Any]]: ...


OPEN_PATHS = frozenset({"/-/health"})


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def require_secret(secret: str | None) -> Any:
    """Every admin route but /-/health needs `Authorization: Bearer <secret>`: the port is on
    loopback, where any local user can reach it."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if secret is None or request.path in OPEN_PATHS:
            return await handler(request)
        given = bearer(request.headers.get("Authorization"))
        if given is None or not hmac.compare_digest(given.encode(), secret.encode()):
            return web.json_response(
                {"error": "unauthorized", "message": "the admin API needs its bearer secret"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check


def make_admin_app(proxy: Proxy, supervisor: Relay | None = None) -> web.Application:
    """The admin API of the primary; with a relay, pushes are passed on to it and its reports
    and metrics are added to this process's own."""
    replicas = proxy.replicas
    service = proxy.config.service

    async def put_replicas(request: web.Request) -> web.Response:
        try:
            push = ReplicaPush.model_validate_json(await request.read())
        except ValidationError as e:
            return web.json_response({"error": "invalid_payload", "message": str(e)}, status=400)
        added, removed = replicas.apply(push)
        if supervisor is not None:
            await supervisor.push(push)
        if added or removed:
            log.info(
                "replica set: %s (added %s, removed %s)",
                sorted(replicas.upstreams),
                sorted(added),
                sorted(removed),
            )
        return web.json_response(
            {"replicas": len(push.replicas), "generation": replicas.generation}
        )

    async def get_replicas(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "service": service,
                "generation": replicas.generation,
                "replicas": [
                    {"replica_id": u.replica_id, "url": u.url, "version": u.version}
                    for u in replicas.upstreams.values()
                ],
                "inflight": {str(k): v for k, v in replicas.inflight.items()},
                # Workers not accepting connections themselves yet (starting, or restarting
                # after a crash), whose sockets this process serves meanwhile.
                "covered_workers": sorted(getattr(supervisor, "covering", {})),
            }
        )

    async def load(_request: web.Request) -> web.Response:
        report = load_report(proxy.load, proxy.metrics, dict(replicas.inflight), proxy.queued)
        if supervisor is not None:
            others = [LoadReport.model_validate(r["load"]) for r in await supervisor.reports()]
            report = merge_load([report, *others])
        return web.json_response(text=report.model_dump_json())

    async def metrics(_request: web.Request) -> web.Response:
        proxy.metrics.sync_inflight(replicas.inflight, set(replicas.upstreams))
        proxy.metrics.set_queued(proxy.queued)
        body = generate_latest(proxy.metrics.registry)
        if supervisor is not None:
            texts = [body.decode(), *(r["metrics"] for r in await supervisor.reports())]
            merged = CollectorRegistry()
            merged.register(MergedMetrics(texts))
            body = generate_latest(merged)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "service": service})

    app = web.Application(middlewares=[require_secret(proxy.config.admin_secret)])
    app.router.add_put("/-/replicas", put_replicas)
    app.router.add_get("/-/replicas", get_replicas)
    app.router.add_get("/-/load", load)
    app.router.add_get("/-/health", health)
    app.router.add_get("/metrics", metrics)
    return app
