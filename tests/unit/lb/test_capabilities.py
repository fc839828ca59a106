"""A policy the load balancer has never heard of, defined here only, routes through the real
proxy on loopback: the LB finds what it can do (fleetserve.policies.capabilities) and never
names a policy, so a new one changes no file in fleetserve.lb."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleetserve.lb.config import LbConfig
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.lb import NO_KEY, RequestKey
from fleetserve.spec.models import LoadBalancerOptions


class Tenants:
    """Tenant "a" to replica 1, any other to replica 2, no tenant to the first candidate."""

    def __init__(self) -> None:
        self.bodies: list[tuple[int, bool]] = []  # (bytes it was given, complete)
        self.forgotten: list[int] = []

    def forget(self, replica: int) -> None:
        self.forgotten.append(replica)

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        left = [rid for rid in candidates if rid not in exclude]
        if not left:
            return None
        wanted = None if key.session is None else (1 if key.session == "a" else 2)
        return wanted if wanted in left else left[0]


class ByTenant(Tenants):
    """Keys on the body's JSON field `tenant`; reads at most `body_limit` bytes of a body."""

    body_limit = 1024

    def body_key(self, body: bytes, complete: bool) -> RequestKey:
        self.bodies.append((len(body), complete))
        text = body.decode(errors="replace")
        if complete:
            tenant = json.loads(text).get("tenant")
        else:  # the start of a long body: `{"tenant": "x", ...`
            _, found, rest = text.partition('"tenant": "')
            tenant = rest.split('"', 1)[0] if found else None
        return RequestKey(session=tenant) if tenant else NO_KEY


class ByTenantHeader(Tenants):
    """The same routing from an `X-Tenant` header; it does not read bodies."""

    def header_key(self, headers: Mapping[bytes, bytes]) -> RequestKey:
        tenant = headers.get(b"x-tenant")
        return RequestKey(session=tenant.decode()) if tenant else NO_KEY


class ByTenantLater(ByTenant):
    """Keys on the body, but learns the tenant only in a slow step off the event loop: the
    body's key names a ticket that `complete_key` turns into the tenant."""

    def __init__(self) -> None:
        super().__init__()
        self.completed = 0

    def completes_later(self, key: RequestKey, body: bytes, complete: bool) -> bool:
        return complete and key.session is not None and key.session.startswith("ticket-")

    async def complete_key(self, key: RequestKey, body: bytes) -> RequestKey:
        await asyncio.sleep(0.01)
        self.completed += 1
        assert key.session is not None
        return replace(key, session=key.session.removeprefix("ticket-"))


def named(name: str) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        size = len(await request.read())
        return web.json_response({"replica": name, "bytes": size})

    app = web.Application(client_max_size=1 << 20)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@pytest.fixture
async def two_replicas() -> AsyncIterator[list[Upstream]]:
    runners = []
    upstreams = []
    for rid, name in ((1, "a"), (2, "b")):
        runner = web.AppRunner(named(name))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        upstreams.append(Upstream(rid, f"http://127.0.0.1:{runner.addresses[0][1]}", 1))
    yield upstreams
    for runner in runners:
        await runner.cleanup()


async def serve(selector: Any, upstreams: list[Upstream]) -> tuple[Proxy, str]:
    replicas = ReplicaSet(selector)
    replicas.replace(upstreams)
    # The configured name is round_robin: what routes is the selector installed, not the name.
    config = LbConfig(
        service="svc",
        port=0,
        admin_port=0,
        policy="round_robin",
        options=LoadBalancerOptions(),
    )
    proxy = Proxy(config, replicas)
    await proxy.serve("127.0.0.1", 0)
    return proxy, f"http://127.0.0.1:{proxy.port}"


async def post(s: aiohttp.ClientSession, url: str, body: bytes, **headers: str) -> Any:
    async with s.post(url, data=body, headers=headers) as r:
        assert r.status == 200
        return await r.json()


async def test_a_body_policy_defined_only_here_routes_through_the_proxy(
    two_replicas: list[Upstream],
) -> None:
    policy = ByTenant()
    proxy, lb = await serve(policy, two_replicas)
    try:
        async with aiohttp.ClientSession() as s:
            seen = [
                (await post(s, f"{lb}/v1/x", json.dumps({"tenant": t}).encode()))["replica"]
                for t in ("b", "b", "a", "b", "a", "a")
            ]
            assert seen == ["b", "b", "a", "b", "a", "a"]  # round_robin would alternate
            assert all(complete for _, complete in policy.bodies)
            # A body longer than body_limit: the key comes from its first body_limit bytes,
            # and the whole body still reaches the replica.
            long = b'{"tenant": "a", "pad": "' + b"x" * 20_000 + b'"}'
            answer = await post(s, f"{lb}/v1/x", long)
            assert answer == {"replica": "a", "bytes": len(long)}
            assert policy.bodies[-1] == (ByTenant.body_limit, False)
            # A GET has no body: no key, the first candidate.
            async with s.get(f"{lb}/v1/x") as r:
                assert (await r.json())["replica"] == "a"
        assert len(policy.bodies) == 7
        # A replica that leaves the set is forgotten (ForgetsReplicas).
        proxy.replicas.replace(two_replicas[:1])
        assert policy.forgotten == [2]
    finally:
        await proxy.close(0.1)


async def test_a_header_policy_defined_only_here_gets_the_headers_not_the_body(
    two_replicas: list[Upstream],
) -> None:
    policy = ByTenantHeader()
    proxy, lb = await serve(policy, two_replicas)
    try:
        async with aiohttp.ClientSession() as s:
            body = json.dumps({"tenant": "a"}).encode()
            assert (await post(s, f"{lb}/v1/x", body, **{"X-Tenant": "b"}))["replica"] == "b"
            assert (await post(s, f"{lb}/v1/x", body, **{"X-Tenant": "a"}))["replica"] == "a"
            assert (await post(s, f"{lb}/v1/x", body))["replica"] == "a"
        assert policy.bodies == []
    finally:
        await proxy.close(0.1)


async def test_a_policy_completes_its_key_off_the_event_loop(
    two_replicas: list[Upstream],
) -> None:
    policy = ByTenantLater()
    proxy, lb = await serve(policy, two_replicas)
    try:
        async with aiohttp.ClientSession() as s:
            # Unfinished, "ticket-a" would go to replica b.
            ticket = json.dumps({"tenant": "ticket-a"}).encode()
            assert (await post(s, f"{lb}/v1/x", ticket))["replica"] == "a"
            assert (await post(s, f"{lb}/v1/x", ticket))["replica"] == "a"
            assert policy.completed == 2
            plain = json.dumps({"tenant": "b"}).encode()
            assert (await post(s, f"{lb}/v1/x", plain))["replica"] == "b"
            assert policy.completed == 2  # (not asked to: the key was whole)
    finally:
        await proxy.close(0.1)
