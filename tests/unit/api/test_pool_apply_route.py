"""PUT /api/v1/pools/{name} answers with the size just asked for, not the last round's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.settings import Settings
from tests.unit.controller.fakes import FakeInfra, FakeLb

POOL = "pool:\n  workers: 3\nsetup: echo ready\n"


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Controller]:
    """The controller behind the routes, on the fake infra: applying a pool starts its
    reconciler, whose workers must not be real processes that outlive the test."""
    settings = Settings.from_env_dict({"FLEETSERVE_HOME": str(tmp_path / "home")})
    settings.home.mkdir(mode=0o700)
    controller = Controller(settings, infra=FakeInfra())
    controller.lb = cast(LbManager, FakeLb())  # nor load balancers
    yield controller
    controller.store.close()


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
        assert body["note"] is None  # a fixed pool stays fixed: nothing to say


def test_fixing_an_autoscaling_pools_size_says_what_it_ended(
    api: tuple[TestClient, Controller],
) -> None:
    client, _ctl = api
    ranged = "pool:\n  min_workers: 1\n  max_workers: 4\nsetup: echo ready\n"
    assert client.put("/api/v1/pools/batch", json={"yaml": ranged}).status_code == 200
    resized = client.put("/api/v1/pools/batch", json={"workers": 2}).json()
    assert resized["action"] == "resized in place"
    assert resized["pool"]["min_replicas"] == resized["pool"]["max_replicas"] == 2
    assert "no longer autoscales between 1 and 4 workers" in resized["note"]
