"""Persistence: SQLAlchemy 2 tables on SQLite (WAL), migrated with Alembic.

`Store` is imported on first use: the CLI reads `fleetserve.store.url` (through the settings)
and never opens a store, while the store's module brings in Alembic, which every CLI command
(`fleetserve status`) then paid for at its start."""

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
