"""The API's routes over a real controller object (its store on SQLite in the test's folder),
not started: no lifespan, no reconciler; the routes read and write its store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fleetserve.api.app import create_app
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings

TOKEN = "t" * 43


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Controller]:
    settings = Settings.from_env_dict({"FLEETSERVE_HOME": str(tmp_path / "home")})
    settings.home.mkdir(mode=0o700)
    controller = Controller(settings)
    yield controller
    controller.store.close()


@pytest.fixture
def api(ctl: Controller) -> tuple[TestClient, Controller]:
    """A client with the token, and the controller behind it."""
    client = TestClient(
        create_app(ctl, token=TOKEN),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    return client, ctl
