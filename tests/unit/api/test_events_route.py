"""GET /api/v1/services/{name}/events: each event's event_id, and `after` to follow them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller


def test_events_carry_their_id_and_after_gives_the_next_ones(
    api: tuple[TestClient, Controller],
) -> None:
    client, ctl = api
    ctl.store.create_service("web", "y", "{}", 1.0)
    for i in range(4):
        ctl.store.add_event("web", 10.0 + i, "note", f"e{i}")
    body = client.get("/api/v1/services/web/events").json()[1:]  # after "service created"
    ids = [e["event_id"] for e in body]
    assert [e["message"] for e in body] == ["e0", "e1", "e2", "e3"] and ids == sorted(ids)
    after = client.get("/api/v1/services/web/events", params={"after": ids[1], "limit": 1})
    assert [e["message"] for e in after.json()] == ["e2"]
    rest = client.get("/api/v1/services/web/events", params={"after": ids[2]}).json()
    assert [e["message"] for e in rest] == ["e3"]
    assert client.get("/api/v1/services/web/events", params={"after": ids[3]}).json() == []


@pytest.mark.parametrize("after", ["-1", "x", str(2**63)])
def test_a_bad_after_is_a_422_naming_it(api: tuple[TestClient, Controller], after: str) -> None:
    client, ctl = api
    ctl.store.create_service("web", "y", "{}", 1.0)
    resp = client.get("/api/v1/services/web/events", params={"after": after})
    assert resp.status_code == 422 and "after" in resp.json()["error"]["message"]


def test_events_of_a_missing_service_are_a_404(api: tuple[TestClient, Controller]) -> None:
    client, _ = api
    resp = client.get("/api/v1/services/nope/events", params={"after": 0})
    assert resp.status_code == 404
