"""Fixtures shared by the controller's unit tests: a fake clock and a store on a real SQLite
file in the test's own folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.store import Store


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.at_path(tmp_path / "db.sqlite")
    yield s
    s.close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path)
