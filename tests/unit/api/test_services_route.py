"""GET /api/v1/services reads the store a fixed number of times, however many services there
are (it read each service's replicas, spec and policy state apart), and says what
GET /api/v1/services/{name} says of each."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event

from fleetserve.controller.controller import Controller
from fleetserve.core.status import ReplicaStatus
from fleetserve.spec.loader import parse_spec

YAML = "service:\n  readiness_probe: /health\n  replicas: {n}\nrun: python3 server.py\n"


def add_services(ctl: Controller, names: list[str], replicas: int = 2) -> None:
    for name in names:
        text = YAML.format(n=replicas)
        ctl.store.create_service(name, text, parse_spec(text).model_dump_json(), 1.0)
        for i in range(replicas):
            rec = ctl.store.allocate_replica(name, 1, "local", f"{name}-{i}", 2.0)
            if i == 0:
                ctl.store.update_replica(rec, 3.0, status=ReplicaStatus.READY)
        ctl.store.put_policy_state(name, "autoscaler", {"target": replicas + 1}, 4.0)


def statements_of(ctl: Controller, client: TestClient, path: str) -> tuple[int, Any]:
    seen: list[str] = []

    def count(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(ctl.store.engine, "before_cursor_execute", count)
    try:
        body = client.get(path).json()
    finally:
        event.remove(ctl.store.engine, "before_cursor_execute", count)
    return len(seen), body


def test_listing_services_reads_the_store_a_fixed_number_of_times(
    api: tuple[TestClient, Controller],
) -> None:
    client, ctl = api
    add_services(ctl, ["a", "b"])
    client.get("/api/v1/services")  # specs parsed and kept
    two, _ = statements_of(ctl, client, "/api/v1/services")
    add_services(ctl, [f"s{i}" for i in range(8)])
    client.get("/api/v1/services")
    ten, body = statements_of(ctl, client, "/api/v1/services")
    assert ten == two, f"{two} statements for 2 services, {ten} for 10"
    assert len(body) == 10
    for svc in body:
        one = client.get(f"/api/v1/services/{svc['name']}").json()
        assert svc == one
        assert [r["status"] for r in svc["replicas"]] == ["READY", "PENDING"]
        assert svc["target_replicas"] == 3  # the autoscaler's state, read for all at once


def test_a_service_made_again_under_its_name_shows_its_new_spec(
    api: tuple[TestClient, Controller],
) -> None:
    """Parsed specs are kept per version: a service taken down and made again (version 1
    again) is not shown with the old one's."""
    client, ctl = api
    add_services(ctl, ["web"], replicas=2)
    assert client.get("/api/v1/services/web").json()["min_replicas"] == 2
    ctl.store.delete_service("web")
    text = YAML.format(n=5)
    ctl.store.create_service("web", text, parse_spec(text).model_dump_json(), 9.0)
    assert client.get("/api/v1/services/web").json()["min_replicas"] == 5


def test_a_nul_in_an_override_or_a_relative_base_dir_is_a_422_and_stores_nothing(
    api: tuple[TestClient, Controller],
) -> None:
    """A NUL byte cannot be put in a process environment or a path: refused when the request
    comes (it was accepted, then failed every launch); a relative base_dir would resolve
    against whatever folder the controller was started in."""
    client, ctl = api
    text = YAML.format(n=1)
    for body, where in (
        ({"envs": {"A": "x\u0000y"}}, "envs"),
        ({"secrets": {"S\u0000": "v"}}, "secrets"),
        ({"base_dir": "/tmp\u0000x"}, "base_dir"),
        ({"base_dir": "relative/dir"}, "base_dir"),
    ):
        r = client.post("/api/v1/services", json={"yaml": text, "name": "web", **body})
        assert r.status_code == 422, (body, r.text)
        assert where in r.text and ("NUL" in r.text or "absolute" in r.text)
        r = client.post("/api/v1/services/web/update", json={"yaml": text, **body})
        assert r.status_code in (404, 422), r.text
    assert ctl.store.get_service("web") is None
