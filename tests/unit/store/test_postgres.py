"""The store on a real PostgreSQL server (tests/pg.py): the migrations build the declared
schema, concurrent writers never share an id, and a database that cannot be used is refused
in one line that never shows the password."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from fleetserve.controller.settings import Settings
from fleetserve.store import Store
from fleetserve.store.db import UnusableStore
from fleetserve.store.tables import metadata
from tests.pg import ADMIN, PASSWORD, PgCluster

T = TypeVar("T")


def test_the_migrations_build_exactly_the_declared_schema(store: Store) -> None:
    """From an empty database to head: every table, column type, nullability, key, index
    and unique constraint of tables.py, on SQLite and on PostgreSQL alike."""
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, metadata) == []


def _in_threads(n: int, work: Callable[[int], T]) -> list[T]:
    start = threading.Barrier(n)

    def run(i: int) -> T:
        start.wait()  # all at once
        return work(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_two_controllers_allocating_replica_ids_never_share_one(pg_url: str) -> None:
    stores = [Store(pg_url), Store(pg_url)]
    stores[0].create_service("a", "y", "{}", 1.0)
    per_thread = 15

    def allocate(i: int) -> list[int]:
        store = stores[i % 2]
        return [
            store.allocate_replica("a", 1, "local", f"t{i}-{k}", 2.0).replica_id
            for k in range(per_thread)
        ]

    ids = [rid for batch in _in_threads(6, allocate) for rid in batch]
    assert sorted(ids) == list(range(1, 6 * per_thread + 1))  # no duplicate, no gap
    assert stores[1].service("a").next_replica_id == 6 * per_thread + 1
    created = [e for e in stores[1].list_events("a", limit=1000) if e.status_to == "PENDING"]
    assert sorted(e.replica_id or 0 for e in created) == sorted(ids)
    for s in stores:
        s.close()


def test_concurrent_versions_policy_state_and_home_claims(pg_url: str, tmp_path: Path) -> None:
    stores = [Store(pg_url), Store(pg_url)]
    stores[0].create_service("a", "y", "{}", 1.0)
    versions = _in_threads(6, lambda i: stores[i % 2].add_version("a", f"y{i}", "{}", 2.0))
    assert sorted(versions) == list(range(2, 8))
    # The first write of a policy's state from two writers at once: one inserts, one updates.
    _in_threads(6, lambda i: stores[i % 2].put_policy_state("a", "p", {"i": i}, 3.0))
    assert stores[0].get_policy_state("a", "p") in [{"i": i} for i in range(6)]
    # Two controllers of one home starting at once: one home id, written once.
    ids = _in_threads(4, lambda i: stores[i % 2].claim_home(tmp_path))
    assert len(set(ids)) == 1
    for s in stores:
        s.close()


def test_a_follower_sees_every_event_while_two_controllers_write(pg_url: str) -> None:
    """Events commit in the order of their ids, so `list_events(after=ID)` skips none."""
    stores = [Store(pg_url), Store(pg_url)]
    stores[0].create_service("a", "y", "{}", 1.0)
    writers_done = threading.Event()
    seen: list[int] = []

    def follow() -> None:
        last = 0
        while True:
            done = writers_done.is_set()
            while batch := stores[0].list_events("a", limit=50, after=last):
                seen.extend(e.id for e in batch)
                last = batch[-1].id
            if done:
                return

    follower = threading.Thread(target=follow)
    follower.start()

    def write_events(i: int) -> None:
        for k in range(40):
            stores[i % 2].add_event("a", 1.0, "note", f"{i}.{k}")

    _in_threads(6, write_events)
    jobs = _in_threads(
        2, lambda i: stores[i].add_jobs("a", None, "true", {}, 20, 1.0, ["t"] * 20, 2.0)
    )
    writers_done.set()
    follower.join(30)
    every = [e.id for e in stores[1].list_events("a", limit=1000)]
    assert seen == every and len(every) == 1 + 6 * 40 + 2
    for launch in jobs:  # each launch's ids in a row, even with another launch at once
        ids = [j.job_id for j in launch]
        assert ids == list(range(ids[0], ids[0] + 20))
    for s in stores:
        s.close()


# -- a server or database that cannot be used: one line, exit code 6, no password -----------


def _refusal(url: str) -> str:
    with pytest.raises(UnusableStore) as e:
        Store(url)
    message = e.value.message
    assert e.value.exit_code == 6 and "\n" not in message
    assert PASSWORD not in message and quote(PASSWORD, safe="") not in message
    assert "pw-Zq9" not in message and "***" in message
    return message


def test_a_wrong_password_is_refused_clearly(pg_cluster: PgCluster, pg_url: str) -> None:
    db = pg_url.rsplit("/", 1)[1]
    message = _refusal(pg_cluster.url(db, password="wrong-" + PASSWORD))
    assert "refused the login of user 'fleet' (wrong password or user?)" in message
    assert "wrong-" not in message


def test_a_missing_database_is_refused_clearly(pg_cluster: PgCluster) -> None:
    message = _refusal(pg_cluster.url("no_such_db"))
    assert "the PostgreSQL database 'no_such_db' does not exist" in message
    assert "createdb -O fleet no_such_db" in message


def test_an_unreachable_server_is_refused_clearly(pg_cluster: PgCluster) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = pg_cluster.url("fleet").replace(f":{pg_cluster.port}/", f":{port}/")
    message = _refusal(url)
    assert f"cannot reach the PostgreSQL server at 127.0.0.1:{port} (connection refused)" in (
        message
    )


def test_a_database_of_another_owner_is_refused_clearly(pg_cluster: PgCluster) -> None:
    pg_cluster.admin(f"CREATE DATABASE not_fleets OWNER {ADMIN}")  # fleet may not create tables
    message = _refusal(pg_cluster.url("not_fleets"))
    assert "permission denied for schema public (the user must own the database" in message


def test_the_controller_takes_its_store_from_a_url_file(pg_url: str, tmp_path: Path) -> None:
    url_file = tmp_path / "db-url"
    url_file.write_text(pg_url + "\n")
    url_file.chmod(0o600)
    settings = Settings.from_env_dict(
        {"FLEETSERVE_HOME": str(tmp_path / "home"), "FLEETSERVE_DB_URL_FILE": str(url_file)}
    )
    store = Store.open(settings.db_path, settings.store_url())
    assert store.postgres and store.where.startswith("postgresql+psycopg://fleet:***@127.0.0.1")
    assert not settings.db_path.exists()  # no SQLite file made on the side
    store.close()
