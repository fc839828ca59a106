"""GET /metrics on the controller's API port: Prometheus text, behind the API token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.api.app import create_app
from fleetserve.api.auth import ApiGuard
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.store import Store
from tests.unit.controller.fakes import FakeInfra, create_service, service_yaml

TOKEN = "t" * 43


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Controller]]:
    store = Store.at_path(tmp_path / "db.sqlite")
    ctl = Controller(Settings(home=tmp_path), FakeClock(), FakeInfra(), store)
    app = create_app(ctl, token=TOKEN)  # no lifespan: no reconciler runs
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:46580") as c:
        yield c, ctl
    await ctl.http.aclose()
    store.close()


def test_the_guard_wants_the_token_for_metrics() -> None:
    async def app(_scope: object, _receive: object, _send: object) -> None:
        raise AssertionError

    guard = ApiGuard(app, TOKEN, frozenset({"127.0.0.1"}), lambda _name: None)
    host = (b"host", b"127.0.0.1:46580")
    assert guard.check("GET", "/metrics", [host]) == (
        401,
        "unauthorized",
        "missing `Authorization: Bearer <token>`",
    )
    wrong = (b"authorization", b"Bearer nope")
    assert (guard.check("GET", "/metrics", [host, wrong]) or (0,))[0] == 401
    right = (b"authorization", f"Bearer {TOKEN}".encode())
    assert guard.check("GET", "/metrics", [host, right]) is None


async def test_metrics_need_the_token_and_show_the_fleet(
    api: tuple[httpx.AsyncClient, Controller],
) -> None:
    client, ctl = api
    now = ctl.clock.now()
    create_service(ctl.store, "web", service_yaml(replicas=2), now)
    ctl.store.update_service("web", now, lb_pid=4242)
    for token in ("a", "b"):
        rec = ctl.store.allocate_replica("web", 1, "fake", token, now)
        for status in (ReplicaStatus.PROVISIONING, ReplicaStatus.STARTING, ReplicaStatus.READY):
            rec = ctl.store.update_replica(rec, now, status=status)

    refused = await client.get("/metrics")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert "fleetserve" not in refused.text
    assert (await client.get("/metrics", headers={"Authorization": "Bearer no"})).status_code == 401

    resp = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == CONTENT_TYPE_LATEST
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    }

    def sample(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert sample("fleetserve_controller_replicas", service="web", status="READY") == 2
    assert sample("fleetserve_controller_replicas", service="web", status="STARTING") == 0
    assert sample("fleetserve_controller_ready_replicas", service="web") == 2
    assert sample("fleetserve_controller_target_replicas", service="web") == 2
    assert sample("fleetserve_controller_service_status", service="web", status="READY") == 1
    launches = "fleetserve_controller_replica_launches_total"
    assert sample(launches, service="web", kind="on_demand") == 2
    assert sample("fleetserve_controller_services") == 1
    # Not part of the REST API's schema (a scrape target, not an API call).
    schema = await client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert "/metrics" not in schema.json()["paths"]
