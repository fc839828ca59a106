"""PUT /api/v1/pools/{name} answers with the size just asked for, not the last round's."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller

POOL = "pool:\n  workers: 3\nsetup: echo ready\n"


def test_resizing_a_pool_answers_the_new_size(api: tuple[TestClient, Controller]) -> None:
    client, ctl = api
    made = client.put("/api/v1/pools/batch", json={"yaml": POOL})
    assert made.status_code == 200, made.text
    assert made.json()["pool"]["target_replicas"] == 3
    # The pool's autoscaler ran at the old size (3) before the resize.
    ctl.store.put_policy_state("batch", "pool_autoscaler", {"target": 3}, 1.0)
    for workers in (1, 5):
        resized = client.put("/api/v1/pools/batch", json={"workers": workers})
        assert resized.status_code == 200, resized.text
        body = resized.json()
        assert body["action"] == "resized in place"
        assert body["pool"]["target_replicas"] == workers
        assert body["pool"]["min_replicas"] == body["pool"]["max_replicas"] == workers
