"""The store's tests run on both backends: SQLite (a file in tmp_path) and PostgreSQL (a new
database of the session's private server, tests/pg.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from fleetserve.store import Store
from fleetserve.store.url import normalize_db_url


@dataclass
class Backend:
    name: str  # "sqlite" or "postgresql"
    url: str
    path: Path | None = None  # SQLite's file
    opened: list[Store] = field(default_factory=list)

    def open(self) -> Store:
        """A new Store on this database (another controller's, or the same one restarted)."""
        store = Store.at_path(self.path) if self.path is not None else Store(self.url)
        self.opened.append(store)
        return store

    def sql(self, *statements: str) -> None:
        """Run statements on the database behind the store's back, in one transaction."""
        url = self.url if self.path is not None else normalize_db_url(self.url)
        engine = create_engine(url)
        try:
            with engine.begin() as conn:
                for statement in statements:
                    conn.execute(text(statement))
        finally:
            engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "db.sqlite"
        b = Backend("sqlite", f"sqlite:///{path}", path)
    else:
        b = Backend("postgresql", request.getfixturevalue("pg_url"))
    yield b
    for store in b.opened:
        store.close()


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.open()
