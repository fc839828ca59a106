"""The store on a real SQLite file and a real PostgreSQL database (the `backend` fixture,
conftest.py): migrations, ids never reused, events, policy state, identity."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, inspect, text

from fleetserve.core.errors import Conflict, NotFound
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import TerminationCause, deletes_row
from fleetserve.store import Store
from fleetserve.store.db import _KNOWN_REVISIONS, UnusableStore
from tests.unit.store.conftest import Backend


def test_schema_is_created_by_alembic_in_wal_mode(store: Store, backend: Backend) -> None:
    tables = set(inspect(store.engine).get_table_names())
    assert {
        "services",
        "versions",
        "replicas",
        "events",
        "policy_state",
        "alembic_version",
    } <= tables
    with store.engine.connect() as conn:
        if backend.name == "sqlite":
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        head = max(_KNOWN_REVISIONS)
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head


def test_reopening_keeps_data(backend: Backend) -> None:
    s1 = backend.open()
    s1.create_service("a", "yaml", "{}", 1.0)
    s1.close()
    s2 = backend.open()
    assert s2.service("a").name == "a"
    assert s2.version("a", 1).yaml_text == "yaml"


def test_duplicate_service_is_a_conflict(store: Store) -> None:
    store.create_service("a", "y", "{}", 1.0)
    with pytest.raises(Conflict):
        store.create_service("a", "y", "{}", 2.0)
    with pytest.raises(NotFound):
        store.service("b")


def test_replica_ids_are_never_reused(store: Store) -> None:
    store.create_service("a", "y", "{}", 1.0)
    r1 = store.allocate_replica("a", 1, "local", "t1", 2.0)
    r2 = store.allocate_replica("a", 1, "local", "t2", 2.0)
    store.delete_replica("a", r2.replica_id, 3.0, "gone")
    r3 = store.allocate_replica("a", 1, "local", "t3", 4.0)
    assert (r1.replica_id, r2.replica_id, r3.replica_id) == (1, 2, 3)


def test_status_changes_are_events(store: Store) -> None:
    store.create_service("a", "y", "{}", 1.0)
    r = store.allocate_replica("a", 1, "local", "t", 2.0)
    r = store.update_replica(r, 3.0, status=ReplicaStatus.PROVISIONING)
    r = store.update_replica(r, 4.0, status=ReplicaStatus.FAILED_PROVISION, reason="setup failed")
    assert store.replica("a", 1).reason == "setup failed"
    changes = [(e.status_from, e.status_to, e.message) for e in store.list_events("a")]
    assert changes[-2:] == [
        ("PENDING", "PROVISIONING", "status PROVISIONING"),
        ("PROVISIONING", "FAILED_PROVISION", "setup failed"),
    ]
    with pytest.raises(ValueError, match="not replica columns"):
        store.update_replica(r, 5.0, bogus=1)


def test_policy_state_round_trip_and_delete_service_removes_everything(store: Store) -> None:
    store.create_service("a", "y", "{}", 1.0)
    store.allocate_replica("a", 1, "local", "t", 2.0)
    store.put_policy_state("a", "autoscaler", {"target": 3}, 2.0)
    store.put_policy_state("a", "autoscaler", {"target": 4}, 3.0)
    assert store.get_policy_state("a", "autoscaler") == {"target": 4}
    store.delete_service("a")
    with store.engine.connect() as conn:
        for table in ("services", "versions", "replicas", "events", "policy_state"):
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0


@contextlib.contextmanager
def at_revision(backend: Backend, revision: str, down: bool = False) -> Iterator[Connection]:
    """A connection to the backend's database in a transaction, after Alembic has taken it up
    (or, `down`, back down) to `revision`: a store of an older fleetserve, to open."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from fleetserve.store.db import _MIGRATIONS
    from fleetserve.store.url import is_postgres, normalize_db_url

    url = normalize_db_url(backend.url) if is_postgres(backend.url) else backend.url
    engine = create_engine(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
            yield conn
    finally:
        engine.dispose()


def test_a_database_of_the_first_schema_is_upgraded_in_place(backend: Backend) -> None:
    """A store written before migration 0002 opens with its rows intact and the new columns."""
    with at_revision(backend, "0001") as conn:
        conn.execute(
            text(
                "INSERT INTO services (name, phase, active_version, created_at, updated_at, "
                "next_replica_id, purge) VALUES ('old', 'ACTIVE', 1, 1.0, 1.0, 3, false)"
            )
        )
    store = backend.open()
    svc = store.service("old")
    assert svc.next_replica_id == 3 and svc.stable_version is None and svc.serving_version == 1
    store.create_service("new", "y", "{}", 2.0)
    assert store.add_version("new", "y2", "{}", 3.0) == 2
    assert svc.lb_secret is None and store.home_id() is None  # 0003's columns, still unset
    old = store.allocate_replica("old", 1, "local", "tok", 4.0)
    assert old.replica_id == 3 and old.zone is None and old.spot is False  # 0004's
    assert store.allocate_replica("old", 1, "local", "tok2", 5.0, spot=True).spot is True


def test_a_database_of_revision_0006_gains_the_hosts_with_its_rows_intact(
    backend: Backend,
) -> None:
    """Migration 0007: services.lb_host and replicas.host, NULL for the rows already there
    (recorded before hosts were: this host's), written and read back afterwards."""
    with at_revision(backend, "0006") as conn:
        conn.execute(
            text(
                "INSERT INTO services (name, phase, active_version, created_at, updated_at, "
                "next_replica_id, purge, lb_port, lb_pid, lb_create_time) VALUES ('old', "
                "'ACTIVE', 1, 1.0, 1.0, 2, false, 30001, 4242, 12.5)"
            ),
        )
        conn.execute(
            text(
                "INSERT INTO replicas (service, replica_id, version, status, infra, "
                "launch_token, created_at, updated_at, scale_down, purge, spot) VALUES "
                "('old', 1, 1, 'READY', 'local', 'tok', 1.0, 1.0, false, false, false)"
            )
        )
    store = backend.open()
    svc, rep = store.service("old"), store.replica("old", 1)
    assert (svc.lb_pid, svc.lb_port, svc.lb_host) == (4242, 30001, None)
    assert (rep.launch_token, rep.status, rep.host) == ("tok", ReplicaStatus.READY, None)
    assert store.update_service("old", 2.0, lb_host="host-a").lb_host == "host-a"
    assert store.update_replica(rep, 3.0, host="h" * 128).host == "h" * 128
    assert store.replica("old", 1).host == "h" * 128  # the column holds the longest host id
    with store.engine.connect() as conn:
        head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        assert head == max(_KNOWN_REVISIONS)
    store.close()
    # and back down: 0007 (and those after it) are reversible on both
    with at_revision(backend, "0006", down=True) as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("replicas")}
        assert "host" not in columns and "zone" in columns


def test_a_database_of_revision_0007_sorts_its_failure_reasons_into_typed_faults(
    backend: Backend,
) -> None:
    """Migration 0008: services.failure_reason held three facts; each row's goes to its own
    column (by the prefix the old code wrote), and the downgrade puts it back."""
    reasons = {
        "lb": "load balancer: port 30001 is taken",
        "gone": "could not terminate replicas 2 (stuck); `fleetserve down gone --purge` ...",
        "loop": "3 replicas of version 1 in a row failed before ever becoming READY",
        "fine": None,
    }
    with at_revision(backend, "0007") as conn:
        for name, reason in reasons.items():
            conn.execute(
                text(
                    "INSERT INTO services (name, phase, active_version, created_at, updated_at, "
                    "next_replica_id, purge, failure_reason) VALUES (:n, 'ACTIVE', 1, 1.0, 1.0, "
                    "1, false, :r)"
                ),
                {"n": name, "r": reason},
            )
    store = backend.open()
    faults = {
        n: (s.lb_error, s.cleanup_error, s.launch_stop) for n in reasons for s in [store.service(n)]
    }
    assert faults == {
        "lb": (reasons["lb"], None, None),
        "gone": (None, reasons["gone"], None),
        "loop": (None, None, reasons["loop"]),
        "fine": (None, None, None),
    }
    assert {n: store.service(n).failure_reason for n in reasons} == reasons
    store.close()
    with at_revision(backend, "0007", down=True) as conn:
        back = dict(conn.execute(text("SELECT name, failure_reason FROM services")).all())
        columns = {c["name"] for c in inspect(conn).get_columns("services")}
    assert back == reasons
    assert not columns & {"launch_stop", "lb_error", "cleanup_error"}


def test_a_database_of_revision_0008_gives_each_replica_its_termination_cause(
    backend: Backend,
) -> None:
    """Migration 0009: replicas.scale_down ("delete the row afterwards") becomes a typed
    termination_cause, told apart by the words the old code wrote; the other replicas keep
    their rows (no table copy: the service's events and versions stay too), and the
    downgrade derives scale_down back from the cause."""
    rows = {  # replica id: (status, reason, scale_down), and the cause expected
        1: ("SHUTTING_DOWN", "scaled down", True, TerminationCause.SCALE_DOWN),
        2: ("SHUTTING_DOWN", "replaced by version 2", True, TerminationCause.ROLLOUT),
        3: ("SHUTTING_DOWN", "terminated by user", True, TerminationCause.USER),
        4: ("FAILED_CLEANUP", "service shutting down", True, TerminationCause.SERVICE_DOWN),
        5: ("SHUTTING_DOWN", "replica process exited with code 1", False, TerminationCause.FAILURE),
        6: ("PREEMPTED", "instance lost: node gone", False, TerminationCause.PREEMPTION),
        7: ("FAILED_PROBING", "readiness probe failed", False, TerminationCause.FAILURE),
        8: ("READY", None, False, None),
        9: ("FAILED_PROVISION", "setup failed", False, None),
    }
    with at_revision(backend, "0008") as conn:
        conn.execute(
            text(
                "INSERT INTO services (name, phase, active_version, created_at, updated_at, "
                "next_replica_id, purge) VALUES ('old', 'ACTIVE', 2, 1.0, 1.0, 10, false)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO versions (service, version, yaml_text, spec_json, created_at) "
                "VALUES ('old', 1, 'y', '{}', 1.0)"
            )
        )
        for rid, (status, reason, scale_down, _cause) in rows.items():
            conn.execute(
                text(
                    "INSERT INTO replicas (service, replica_id, version, status, reason, infra, "
                    "launch_token, created_at, updated_at, scale_down, purge, spot) VALUES "
                    "('old', :id, 1, :status, :reason, 'local', 'tok', 1.0, 1.0, :down, false, "
                    "false)"
                ),
                {"id": rid, "status": status, "reason": reason, "down": scale_down},
            )
    store = backend.open()
    got = {
        r.replica_id: (r.status.value, r.reason, r.termination_cause)
        for r in store.list_replicas("old")
    }
    assert got == {rid: (st, why, cause) for rid, (st, why, _d, cause) in rows.items()}
    assert [rid for rid in rows if deletes_row(got[rid][2])] == [1, 2, 3, 4]
    assert store.version("old", 1).yaml_text == "y"  # not cascade-deleted by a table copy
    new = store.update_replica(
        store.replica("old", 8),
        2.0,
        status=ReplicaStatus.SHUTTING_DOWN,
        termination_cause=TerminationCause.HOST_LOST,
    )
    assert new.termination_cause is TerminationCause.HOST_LOST
    assert store.replica("old", 8).termination_cause is TerminationCause.HOST_LOST
    store.close()
    with at_revision(backend, "0008", down=True) as conn:
        back: dict[int, object] = dict(
            conn.execute(text("SELECT replica_id, scale_down FROM replicas")).all()
        )
        columns = {c["name"] for c in inspect(conn).get_columns("replicas")}
    assert {rid: bool(down) for rid, down in back.items()} == {
        **{rid: down for rid, (_s, _r, down, _c) in rows.items()},
        8: True,  # host_lost: its row goes
    }
    assert "termination_cause" not in columns


# -- a database that is not this home's own: refused, never turned into a new home ----------


def test_an_empty_database_file_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "fleetserve.db"
    db.touch()
    with pytest.raises(UnusableStore, match=r"fleetserve\.db is empty \(0 bytes\)"):
        Store.at_path(db)
    assert db.stat().st_size == 0  # nothing was written to it


def test_a_corrupt_database_file_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "fleetserve.db"
    db.write_bytes(b"not a database at all, just some text" * 100)
    with pytest.raises(UnusableStore, match="is not an SQLite database"):
        Store.at_path(db)


def test_a_truncated_database_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "fleetserve.db"
    s = Store.at_path(db)
    s.create_service("a", "y", "{}", 1.0)
    s.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    data = db.read_bytes()
    db.write_bytes(data[:100] + b"\x00" * 10 + data[110:2000])
    with pytest.raises(UnusableStore, match=r"cannot be read|not an SQLite"):
        Store.at_path(db)


def test_a_database_of_another_program_is_refused(backend: Backend) -> None:
    backend.sql("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(UnusableStore, match="tables of another program"):
        backend.open()


def test_a_database_of_a_newer_schema_is_refused(backend: Backend) -> None:
    backend.open().close()
    backend.sql("UPDATE alembic_version SET version_num = '0999'")
    with pytest.raises(UnusableStore, match="schema revision 0999, newer than"):
        backend.open()
    backend.sql("SELECT 1 FROM services")  # refused before anything was changed or dropped


def test_a_database_belongs_to_the_home_that_first_used_it(
    tmp_path: Path, backend: Backend
) -> None:
    import shutil

    first, second = tmp_path / "first", tmp_path / "second"
    s = Store.at_path(first / "fleetserve.db") if backend.path else backend.open()
    home_id = s.claim_home(first)
    assert len(home_id) == 12 and s.claim_home(first) == home_id  # stable
    s.close()
    second.mkdir()
    if backend.path:  # SQLite: the file copied into another home
        shutil.copy(first / "fleetserve.db", second / "fleetserve.db")
        copy = Store.at_path(second / "fleetserve.db")
    else:  # PostgreSQL: another home's controller pointed at the same database
        copy = backend.open()
    with pytest.raises(UnusableStore, match=f"belongs to the fleetserve home {first}"):
        copy.claim_home(second)
    assert copy.joined is None
    copy.close()


def test_with_high_availability_another_home_joins_a_postgresql_database(
    tmp_path: Path, backend: Backend
) -> None:
    """FLEETSERVE_HA=1 (`join`): a controller of another home (another host) on the same
    PostgreSQL database takes its home id, so that it finds the deployment's Ray actors.
    An SQLite file in another home is a copy, and still refused, HA or not."""
    import shutil

    first, second = tmp_path / "first", tmp_path / "second"
    s = Store.at_path(first / "fleetserve.db") if backend.path else backend.open()
    home_id = s.claim_home(first, join=True)
    assert s.joined is None  # the first claim joins nobody
    s.close()
    second.mkdir()
    if backend.path:
        shutil.copy(first / "fleetserve.db", second / "fleetserve.db")
        other = Store.at_path(second / "fleetserve.db")
        with pytest.raises(UnusableStore, match=f"belongs to the fleetserve home {first}"):
            other.claim_home(second, join=True)
        other.close()
        return
    other = backend.open()
    assert other.claim_home(second, join=True) == home_id
    assert other.joined == str(first.resolve())
    assert other.claim_home(second, join=True) == home_id  # again: the same, nothing written
    with pytest.raises(UnusableStore, match="FLEETSERVE_HA=1 on each"):
        other.claim_home(second)  # HA off: refused as before, and the message says how
    first_again = backend.open()
    assert first_again.claim_home(first) == home_id  # the first home keeps its claim


# -- load-balancer ports --------------------------------------------------------------------


def test_each_service_gets_its_own_lb_port_and_secret(store: Store) -> None:
    for name in ("a", "b", "c"):
        store.create_service(name, "y", "{}", 1.0)
    a = store.reserve_lb_port("a", 30000, lambda _p: True)
    b = store.reserve_lb_port("b", 30000, lambda _p: True)
    c = store.reserve_lb_port("c", 30000, lambda p: p != 30002)  # 30002 is busy outside
    assert (a.lb_port, b.lb_port, c.lb_port) == (30000, 30001, 30003)
    assert a.lb_secret and b.lb_secret and a.lb_secret != b.lb_secret
    assert store.reserve_lb_port("a", 30000, lambda _p: False) == a  # kept across restarts
    store.delete_service("a")
    store.create_service("d", "y", "{}", 2.0)
    assert store.reserve_lb_port("d", 30000, lambda _p: True).lb_port == 30000  # freed


def test_two_services_can_never_hold_one_port(store: Store) -> None:
    from sqlalchemy.exc import IntegrityError

    store.create_service("a", "y", "{}", 1.0)
    store.create_service("b", "y", "{}", 1.0)
    store.update_service("a", 2.0, lb_port=31000)
    with pytest.raises(IntegrityError):
        store.update_service("b", 2.0, lb_port=31000)


def test_a_new_home_has_no_legacy_path(tmp_path: Path, store: Store) -> None:
    store.claim_home(tmp_path / "a")
    assert store.legacy_home() is None  # a new home: every process it starts has the id


def test_a_home_upgraded_with_services_in_it_remembers_its_legacy_path(
    tmp_path: Path, store: Store
) -> None:
    store.create_service("old", "y", "{}", 1.0)  # rows from before home ids
    store.claim_home(tmp_path / "b")
    assert store.legacy_home() == str(tmp_path / "b")


def test_job_counts_count_each_job_for_at_least_the_floor(store: Store) -> None:
    """Jobs stored with a share under the floor (before it existed) count for the floor, so
    the pool autoscaler sizes the pool for how many jobs a worker runs at once."""
    store.create_service("p", "y", "{}", 1.0)
    store.add_jobs("p", None, "true", {}, 10, 0.001, [f"t{i}" for i in range(10)], 2.0)
    store.add_jobs("p", None, "true", {}, 2, 0.5, ["u0", "u1"], 2.0)
    queued, slots, running = store.job_counts("p")
    assert queued == 12 and slots == pytest.approx(1.01) and running == 0
    queued, slots, running = store.job_counts("p", min_slots=1 / 64)
    assert queued == 12 and slots == pytest.approx(10 / 64 + 1.0)
