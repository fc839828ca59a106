"""Persistence: SQLAlchemy 2 tables on SQLite (WAL), migrated with Alembic.

`Store` is imported on first use: the controller's settings read `fleetserve.store.url`
without opening a store, and the store's module brings in Alembic, which every importer of
this package would otherwise pay for at its start. (The CLI and the SDK import nothing of the
store: the import contract in pyproject.toml.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.store.db import Store

__all__ = ["Store"]


def __getattr__(name: str) -> Any:
    if name == "Store":
        from fleetserve.store.db import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
