"""Persistence: SQLAlchemy 2 tables on SQLite (WAL), migrated with Alembic."""

from fleetserve.store.db import Store

__all__ = ["Store"]
