"""`load_balancer.log_choices`: the load balancer built from its config (as `python -m
fleetserve.lb` builds it) logs one JSON line per cache_aware choice, naming the replica it
chose and why; without the option it logs none."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest
from aiohttp import web

from fleetserve.lb.build import make_proxy
from fleetserve.lb.config import LbConfig
from fleetserve.lb.messages import RoutableReplica
from fleetserve.oshelpers.ports import free_port
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.test_proxy import Start, start  # noqa: F401 - the fixture

SYSTEM = "You are a careful assistant. " * 40


def replica_app(name: str) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"replica": name})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize("enabled", [True, False])
async def test_each_cache_aware_choice_is_logged_with_its_reason(
    start: Start,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    enabled: bool,
) -> None:
    ports = [await start(replica_app(n)) for n in ("a", "b")]
    config = LbConfig(
        service="svc",
        port=free_port(),
        admin_port=free_port(),
        policy="cache_aware",
        options=LoadBalancerOptions(workers=1, log_choices=enabled),
        replicas=[
            RoutableReplica(replica_id=i + 1, url=f"http://127.0.0.1:{p}")
            for i, p in enumerate(ports)
        ],
    )
    proxy = make_proxy(config)
    lb = await start(proxy)
    caplog.set_level(logging.INFO, logger="fleetserve.lb.choices")
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first " * 80}]
    answered = []
    async with aiohttp.ClientSession() as s:
        for i in range(2):
            body = {"model": "m", "messages": turns}
            async with s.post(f"http://127.0.0.1:{lb}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                answered.append((await r.json())["replica"])
            turns = [*turns, {"role": "assistant", "content": f"answer {i} " * 40}]
            turns.append({"role": "user", "content": f"next {i} " * 40})
    lines = [
        json.loads(rec.getMessage().removeprefix("choice "))
        for rec in caplog.records
        if rec.name == "fleetserve.lb.choices"
    ]
    if not enabled:
        assert lines == []
        return
    assert [line["why"] for line in lines] == ["new", "match"]
    first, second = lines
    assert first["replica"] == second["replica"]  # the second turn went where the first did
    assert answered[0] == answered[1] == "ab"[int(first["replica"]) - 1]
    # Each replica's matched blocks, requests in flight, queued blocks, cost.
    assert set(second["replicas"]) == {"1", "2"}
    held = second["replicas"][str(second["replica"])]
    other = second["replicas"][str(3 - int(second["replica"]))]
    assert held[0] > other[0] == 0 and held[0] < second["blocks"]
    assert held[3] < other[3]


def test_the_option_is_refused_where_it_would_log_nothing() -> None:
    """log_choices logs cache_aware's choices: with another policy, or on nginx, a clear error
    instead of a setting that silently does nothing."""
    from fleetserve.spec.loader import InvalidSpec, parse_spec
    from tests.unit.lb.helpers import spec_with_lb

    spec = parse_spec(spec_with_lb("cache_aware", "python", log_choices="true"))
    assert spec.service is not None and spec.service.load_balancer.log_choices
    for policy, plane in (("least_load", "python"), ("cache_aware", "nginx")):
        with pytest.raises(InvalidSpec, match="log_choices logs cache_aware's choices"):
            parse_spec(spec_with_lb(policy, plane, log_choices="true"))
