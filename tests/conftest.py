"""Fixtures shared by unit and end-to-end tests: a private PostgreSQL server (tests/pg.py)."""

from tests.pg import pg_cluster, pg_url

__all__ = ["pg_cluster", "pg_url"]
