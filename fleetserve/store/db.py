"""`Store`: the only code that reads and writes the database.

SQLite in WAL mode under FLEETSERVE_HOME by default, or PostgreSQL (psycopg 3) at
FLEETSERVE_DB_URL (docs/scaling.md). The schema is created and upgraded by Alembic when the
store opens, with the same migrations on both. Methods return frozen records.

Writers may race on PostgreSQL (two controllers on one database, or threads), where SQLite
has one writer at a time: each read-then-write below is kept safe there by a row lock, a
unique constraint and a retry, or an advisory lock (`_serialize`), as its comment says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Unpack

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    Engine,
    Select,
    create_engine,
    delete,
    event,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import DatabaseError, DBAPIError, IntegrityError

from fleetserve.core.errors import Conflict, NotFound, TerminalError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import (
    EventRecord,
    JobChanges,
    JobRecord,
    JobStatus,
    ReplicaChanges,
    ReplicaId,
    ReplicaRecord,
    ServiceChanges,
    ServicePhase,
    ServiceRecord,
    TerminationCause,
    VersionRecord,
)
from fleetserve.store import leader
from fleetserve.store import tables as t
from fleetserve.store.url import is_postgres, mask_url, normalize_db_url, url_password

log = logging.getLogger("fleetserve.store")
# Told of each replica status change once it is committed: (status before or None for a new
# row, the record after). The controller's metrics count transitions here.
ReplicaListener = Callable[[ReplicaStatus | None, ReplicaRecord], None]
_MIGRATIONS = Path(__file__).parent / "migrations"
_KNOWN_REVISIONS = {p.name.split("_", 1)[0] for p in (_MIGRATIONS / "versions").glob("0*.py")}
_SQLITE_MAGIC = b"SQLite format 3\x00"
HOME_ID_LENGTH = 12  # hex digits: short enough to prefix every launch token
PG_CONNECT_TIMEOUT = 10  # seconds: an unreachable PostgreSQL server fails a start, never hangs it
# PostgreSQL advisory locks, held until their transaction ends: one migration at a time, and
# events (and a launch's job ids) committed in the order of their ids (`_serialize`).
_PG_MIGRATE_LOCK = 0x666C_7331
_PG_WRITE_ORDER_LOCK = 0x666C_7332
# PostgreSQL's INTEGER is 32 bits (SQLite's 64): a larger value compared with an id column is
# an error there ("integer out of range"), not a row that is not found.
_PG_INT_MAX = 2**31 - 1


# What a write raises when the database or the disk refuses it (full, gone, read-only).
STORE_FAILURES: tuple[type[Exception], ...] = (DBAPIError, OSError)


def failure_text(e: BaseException) -> str:
    """One line for a store failure: the driver's own words, without SQLAlchemy's statement
    and link (PostgreSQL's messages span several lines)."""
    return " ".join(str(getattr(e, "orig", None) or e).split())[:300]


class UnusableStore(TerminalError):
    """The database cannot be used as it is (empty, corrupt, foreign, newer schema). The
    controller refuses to start and touches no process."""

    kind = "unusable_store"
    exit_code = 6


def check_sqlite_file(path: Path) -> None:
    """Refuse a database file that exists but cannot be ours, before SQLite or Alembic would
    quietly turn it into a new, empty home (and the controller would stop its "orphans")."""
    if not path.exists():
        return
    size = path.stat().st_size
    if size == 0:
        raise UnusableStore(
            f"{path} is empty (0 bytes), so it is not the fleet's database: restore it from a "
            "backup, or delete it to start an empty home (running replicas are left alone)"
        )
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise UnusableStore(
            f"{path} is not an SQLite database (corrupt?): restore it from a backup, or move "
            "it away to start an empty home (running replicas are left alone)"
        )


_REPLICA_COLUMNS = {c.name for c in t.replicas.columns} - {"service", "replica_id"}
_JOB_COLUMNS = {c.name for c in t.jobs.columns} - {"job_id", "pool"}
MAX_JOBS_PER_LAUNCH = 10_000


def _job(row: Row[Any]) -> JobRecord:
    m = dict(row._mapping)
    m["status"] = JobStatus(m["status"])
    return JobRecord(**m)


_SERVICE_COLUMNS = {c.name for c in t.services.columns} - {"name"}


def _row_values(changes: Mapping[str, object], columns: set[str], what: str) -> dict[str, Any]:
    """The row's values for a change set: its names checked (mypy checks typed callers; this
    refuses any other's unknown name before anything is written), enums as their text."""
    unknown = set(changes) - columns
    if unknown:
        raise ValueError(f"not {what} columns: {sorted(unknown)}")
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in changes.items()}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


# Replica rows are read in ReplicaRecord's field order and made into records by position:
# a round of a 1,000-replica service reads every row, and a mapping per row cost more than
# the query (docs/scaling.md).
_REPLICA_FIELDS = tuple(f.name for f in dataclasses.fields(ReplicaRecord))
_STATUS_AT = _REPLICA_FIELDS.index("status")
_STATUSES = {s.value: s for s in ReplicaStatus}
_CAUSE_AT = _REPLICA_FIELDS.index("termination_cause")
_CAUSES = {c.value: c for c in TerminationCause}


def _select_replicas() -> Select[Any]:
    return select(*(t.replicas.c[name] for name in _REPLICA_FIELDS))


def _replica(row: Row[Any]) -> ReplicaRecord:
    values = list(row)
    values[_STATUS_AT] = _STATUSES[values[_STATUS_AT]]
    cause = values[_CAUSE_AT]
    if cause is not None:
        values[_CAUSE_AT] = _CAUSES[cause]
    return ReplicaRecord(*values)


def _service(row: Row[Any]) -> ServiceRecord:
    m = dict(row._mapping)
    m["phase"] = ServicePhase(m["phase"])
    return ServiceRecord(**m)


class Store:
    def __init__(self, url: str) -> None:
        self.postgres = is_postgres(url)
        self.url = normalize_db_url(url) if self.postgres else url
        self.replica_listeners: list[ReplicaListener] = []
        # (holder, generation) of this controller's lease when it runs with a standby: every
        # write checks it first (fleetserve.store.leader). None: the only controller.
        self.fence: tuple[str, int] | None = None
        # The home that first claimed the database, when this one joined its home id
        # (`claim_home` with `join`); None otherwise.
        self.joined: str | None = None
        options: dict[str, Any] = {}
        if self.postgres:
            # pre_ping: a connection the server dropped (a restart, a failover) is replaced
            # before use. repr(engine) and SQLAlchemy's logs mask the password.
            options = {
                "pool_pre_ping": True,
                "connect_args": {
                    "connect_timeout": PG_CONNECT_TIMEOUT,
                    "application_name": "fleetserve",
                },
            }
        self.engine: Engine = create_engine(self.url, future=True, **options)
        if self.url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        try:
            self._migrate()
        except DatabaseError as e:
            self.engine.dispose()
            if self.postgres:
                raise UnusableStore(self._postgres_problem(e)) from None
            raise UnusableStore(
                f"{self._where()} cannot be read ({e.orig}): restore it from a backup, or move "
                "it away to start an empty home (running replicas are left alone)"
            ) from None
        except UnusableStore:
            self.engine.dispose()
            raise

    @contextlib.contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction; with a fence (high availability), it first checks that this
        controller still holds the lease, and keeps a takeover out until it commits."""
        with self.engine.begin() as conn:
            if self.fence is not None:
                leader.check(conn, *self.fence)
            yield conn

    # -- the active controller's lease (fleetserve.store.leader) ----------------------------

    def acquire_lease(
        self, holder: str, address: str, now: float, ttl: float
    ) -> leader.Lease | None:
        with self.engine.begin() as conn:
            return leader.acquire(conn, holder, address, now, ttl)

    def renew_lease(self, holder: str, generation: int, now: float, ttl: float) -> bool:
        with self.engine.begin() as conn:
            return leader.renew(conn, holder, generation, now, ttl)

    def release_lease(self, holder: str, generation: int, now: float) -> None:
        with self.engine.begin() as conn:
            leader.release(conn, holder, generation, now)

    def lease(self) -> leader.Lease | None:
        with self.engine.connect() as conn:
            return leader.read(conn)

    @classmethod
    def at_path(cls, path: Path) -> Store:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_sqlite_file(path)
        return cls(f"sqlite:///{path}")

    @classmethod
    def open(cls, path: Path, url: str | None = None) -> Store:
        """PostgreSQL at `url` (fleetserve.store.url.resolve_db_url), else SQLite at `path`."""
        return cls(url) if url else cls.at_path(path)

    def _where(self) -> str:
        if self.url.startswith("sqlite"):
            return self.url.removeprefix("sqlite:///")
        return mask_url(self.url)  # never the password

    @property
    def where(self) -> str:
        """The database, for messages and logs: the SQLite file, or the URL without password."""
        return self._where()

    def _postgres_problem(self, e: DatabaseError) -> str:
        """One line saying why PostgreSQL cannot be used (unreachable, refused login, no such
        database, ...), with the URL's password masked and scrubbed from the driver's words."""
        from sqlalchemy.engine import make_url

        u = make_url(self.url)
        socket_dir = u.query.get("host")  # ?host=/var/run/postgresql: a unix socket
        server = f"{u.host or socket_dir or 'localhost'}:{u.port or 5432}"
        lines = [ln.strip() for ln in str(e.orig or e).splitlines() if ln.strip()]
        detail = lines[0][:300] if lines else type(e).__name__
        password = url_password(self.url)
        if password:
            detail = detail.replace(password, "***")
        low, state = detail.lower(), getattr(e.orig, "sqlstate", None)
        if state in ("28P01", "28000") or "authentication failed" in low or "no password" in low:
            return (
                f"PostgreSQL at {server} refused the login of user {u.username!r} (wrong "
                f"password or user?): fix FLEETSERVE_DB_URL ({self.where})"
            )
        if state == "3D000" or ("database" in low and "does not exist" in low):
            return (
                f"the PostgreSQL database {u.database!r} does not exist on {server}: create it "
                f"(createdb -O {u.username or 'USER'} {u.database}) or fix FLEETSERVE_DB_URL "
                f"({self.where})"
            )
        unreachable = (
            "connection refused",
            "could not connect",
            "timeout expired",
            "could not translate host",
            "failed to resolve",
            "name or service not known",
            "no route to host",
            "network is unreachable",
            "no such file or directory",  # a unix socket
        )
        if any(m in low for m in unreachable):
            why = next(m for m in unreachable if m in low)
            return (
                f"cannot reach the PostgreSQL server at {server} ({why}): is it running and "
                f"listening there? (FLEETSERVE_DB_URL {self.where})"
            )
        if state == "42501" or "permission denied" in low:
            return (
                f"cannot use the PostgreSQL database {self.where}: {detail} (the user must own "
                f"the database: createdb -O {u.username or 'USER'} {u.database}, or ALTER "
                "DATABASE ... OWNER TO it)"
            )
        return f"cannot use the PostgreSQL database {self.where}: {detail}"

    def _migrate(self) -> None:
        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with self.engine.begin() as conn:
            if self.postgres:  # two controllers starting on one new database: one migrates
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATE_LOCK})
            tables = set(inspect(conn).get_table_names())
            if "alembic_version" in tables:
                found = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
                if found is not None and str(found) not in _KNOWN_REVISIONS:
                    raise UnusableStore(
                        f"{self._where()} has schema revision {found}, newer than this "
                        f"fleetserve knows (up to {max(_KNOWN_REVISIONS)}): run the fleetserve "
                        "version that wrote it, or upgrade this one"
                    )
            elif tables:
                raise UnusableStore(
                    f"{self._where()} holds tables of another program "
                    f"({', '.join(sorted(tables)[:3])}): "
                    + (
                        "point FLEETSERVE_DB_URL at an empty database of its own"
                        if self.postgres
                        else "point FLEETSERVE_HOME elsewhere, or move the file away"
                    )
                )
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    # -- identity ------------------------------------------------------------------------

    def claim_home(self, home: Path, join: bool = False) -> str:
        """The home id this database carries, written at its first use in `home`.

        A database copied or moved into another home refuses: its rows name processes of the
        first home, which this controller must neither adopt nor stop. With `join` (high
        availability) a PostgreSQL database is shared on purpose by controllers of other
        homes, on other hosts: they take its home id (Ray actors are found by it), and each
        touches only the processes recorded on its own host (fleetserve.infra.host). An SQLite
        file in another home is still a copy, and refused."""
        where = str(home.resolve())
        for attempt in range(2):
            try:
                with self.engine.begin() as conn:
                    rows = {
                        str(k): str(v)
                        for k, v in conn.execute(select(t.meta.c.key, t.meta.c.value))
                    }
                    home_id, owner = rows.get("home_id"), rows.get("home_path")
                    if home_id is None:
                        home_id = secrets.token_hex(HOME_ID_LENGTH // 2)
                        conn.execute(insert(t.meta).values(key="home_id", value=home_id))
                        conn.execute(insert(t.meta).values(key="home_path", value=where))
                        if conn.execute(select(t.services.c.name).limit(1)).first() is not None:
                            # Upgraded from before home ids: its running processes carry none.
                            conn.execute(insert(t.meta).values(key="legacy_home", value=str(home)))
                        return home_id
                break
            except IntegrityError:  # another controller claimed it meanwhile: read its claim
                if attempt:
                    raise
        if owner != where and join and self.postgres:
            self.joined = owner
            log.info(
                "home %s joins the home id %s of %s (first claimed by the home %s): a "
                "controller of the same high-availability deployment",
                where,
                home_id,
                self._where(),
                owner,
            )
            return str(home_id)
        if owner != where:
            fix = (
                "or point FLEETSERVE_DB_URL at another database (controllers of one "
                "high-availability deployment on other hosts: FLEETSERVE_HA=1 on each)"
                if self.postgres
                else "or move the file away to start an empty home here"
            )
            raise UnusableStore(
                f"{self._where()} belongs to the fleetserve home {owner} (copied or moved?): "
                f"use FLEETSERVE_HOME={owner}, {fix}; no process was touched"
            )
        return str(home_id)

    def legacy_home(self) -> str | None:
        """The FLEETSERVE_HOME value that processes started before home ids carry, if this
        database was upgraded with services in it."""
        with self.engine.connect() as conn:
            value = conn.execute(
                select(t.meta.c.value).where(t.meta.c.key == "legacy_home")
            ).scalar_one_or_none()
        return None if value is None else str(value)

    def home_id(self) -> str | None:
        with self.engine.connect() as conn:
            value = conn.execute(
                select(t.meta.c.value).where(t.meta.c.key == "home_id")
            ).scalar_one_or_none()
        return None if value is None else str(value)

    def close(self) -> None:
        self.engine.dispose()

    # -- services ------------------------------------------------------------------------

    def create_service(
        self, name: str, yaml_text: str, spec_json: str, now: float
    ) -> ServiceRecord:
        try:
            with self._write() as conn:
                conn.execute(
                    insert(t.services).values(
                        name=name,
                        phase=ServicePhase.ACTIVE.value,
                        active_version=1,
                        created_at=now,
                        updated_at=now,
                        next_replica_id=1,
                        purge=False,
                    )
                )
                conn.execute(
                    insert(t.versions).values(
                        service=name,
                        version=1,
                        yaml_text=yaml_text,
                        spec_json=spec_json,
                        created_at=now,
                    )
                )
                self._event(conn, name, now, "service", "service created (version 1)")
        except IntegrityError:
            raise Conflict(f"service {name!r} already exists") from None
        return self.service(name)

    def get_service(self, name: str) -> ServiceRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(t.services).where(t.services.c.name == name)).first()
        return _service(row) if row else None

    def service(self, name: str) -> ServiceRecord:
        rec = self.get_service(name)
        if rec is None:
            raise NotFound(f"service {name!r} does not exist")
        return rec

    def list_services(self) -> list[ServiceRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(t.services).order_by(t.services.c.created_at)).all()
        return [_service(r) for r in rows]

    def update_service(
        self, name: str, now: float, **changes: Unpack[ServiceChanges]
    ) -> ServiceRecord:
        """Write `changes` (columns, checked by mypy: ServiceChanges) to the service's row."""
        values = _row_values(changes, _SERVICE_COLUMNS, "service")
        with self._write() as conn:
            conn.execute(
                update(t.services).where(t.services.c.name == name).values(updated_at=now, **values)
            )
        return self.service(name)

    def reserve_lb_port(
        self, name: str, start: int, usable: Callable[[int], bool], end: int = 65535
    ) -> ServiceRecord:
        """Give the service a load-balancer port and admin secret, in one transaction, before
        its LB starts: no two services of this store ever get the same port (the unique
        constraint backs this up against another controller on the same database)."""
        for _attempt in range(5):
            svc = self.service(name)
            if svc.lb_port is not None and svc.lb_secret:
                return svc
            try:
                with self._write() as conn:
                    taken = {
                        int(p)
                        for p in conn.execute(
                            select(t.services.c.lb_port).where(
                                t.services.c.lb_port.is_not(None), t.services.c.name != name
                            )
                        ).scalars()
                    }
                    port = svc.lb_port
                    if port is None:
                        port = next(
                            (p for p in range(start, end + 1) if p not in taken and usable(p)),
                            None,
                        )
                        if port is None:
                            raise TerminalError(f"no free port for a load balancer from {start}")
                    conn.execute(
                        update(t.services)
                        .where(t.services.c.name == name)
                        .values(lb_port=port, lb_secret=svc.lb_secret or secrets.token_hex(24))
                    )
            except IntegrityError:
                continue  # another writer took that port meanwhile: pick again
            return self.service(name)
        raise Conflict(f"could not reserve a load-balancer port for {name!r}: try again")

    def delete_service(self, name: str) -> None:
        with self._write() as conn:
            for table in (t.policy_state, t.events, t.replicas, t.versions):
                conn.execute(delete(table).where(table.c.service == name))
            conn.execute(delete(t.services).where(t.services.c.name == name))

    def add_version(self, service: str, yaml_text: str, spec_json: str, now: float) -> int:
        """Store a new version of the service's spec; returns its number."""
        with self._write() as conn:
            # The service's row locked (PostgreSQL) first: two at once would both take latest+1.
            conn.execute(
                select(t.services.c.name).where(t.services.c.name == service).with_for_update()
            )
            latest = conn.execute(
                select(t.versions.c.version)
                .where(t.versions.c.service == service)
                .order_by(t.versions.c.version.desc())
                .limit(1)
            ).scalar_one()
            version = int(latest) + 1
            conn.execute(
                insert(t.versions).values(
                    service=service,
                    version=version,
                    yaml_text=yaml_text,
                    spec_json=spec_json,
                    created_at=now,
                )
            )
        return version

    def version(self, service: str, version: int) -> VersionRecord:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(t.versions).where(
                    t.versions.c.service == service, t.versions.c.version == version
                )
            ).first()
        if row is None:
            raise NotFound(f"service {service!r} has no version {version}")
        return VersionRecord(**row._mapping)

    # -- replicas ------------------------------------------------------------------------

    def allocate_replica(
        self, service: str, version: int, infra: str, token: str, now: float, spot: bool = False
    ) -> ReplicaRecord:
        """Take the next replica id (never reused) and write its PENDING row, atomically."""
        with self._write() as conn:
            # Increment first, then read: the UPDATE row-locks the service (PostgreSQL), so a
            # concurrent writer waits and reads the id after ours; read-then-write would hand
            # both the same id. On SQLite it takes the write lock at once.
            conn.execute(
                update(t.services)
                .where(t.services.c.name == service)
                .values(next_replica_id=t.services.c.next_replica_id + 1, updated_at=now)
            )
            next_id = ReplicaId(
                int(
                    conn.execute(
                        select(t.services.c.next_replica_id).where(t.services.c.name == service)
                    ).scalar_one()
                )
                - 1
            )
            conn.execute(
                insert(t.replicas).values(
                    service=service,
                    replica_id=next_id,
                    version=version,
                    status=ReplicaStatus.PENDING.value,
                    infra=infra,
                    launch_token=token,
                    created_at=now,
                    updated_at=now,
                    purge=False,
                    spot=spot,
                )
            )
            created = "spot replica created" if spot else "replica created"
            self._event(conn, service, now, "replica", created, next_id, None, "PENDING")
        rec = self.replica(service, next_id)
        self._tell(None, rec)
        return rec

    def get_replica(self, service: str, replica_id: ReplicaId) -> ReplicaRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                _select_replicas().where(
                    t.replicas.c.service == service, t.replicas.c.replica_id == replica_id
                )
            ).first()
        return _replica(row) if row else None

    def replica(self, service: str, replica_id: ReplicaId) -> ReplicaRecord:
        rec = self.get_replica(service, replica_id)
        if rec is None:
            raise NotFound(f"service {service!r} has no replica {replica_id}")
        return rec

    def list_replicas(self, service: str) -> list[ReplicaRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                _select_replicas()
                .where(t.replicas.c.service == service)
                .order_by(t.replicas.c.replica_id)
            ).all()
        return [_replica(r) for r in rows]

    def replicas_by_service(self) -> dict[str, list[ReplicaRecord]]:
        """Every service's replicas (by id) in one read: a listing of every service asks
        once, not once per service."""
        out: dict[str, list[ReplicaRecord]] = {}
        with self.engine.connect() as conn:
            rows = conn.execute(
                _select_replicas().order_by(t.replicas.c.service, t.replicas.c.replica_id)
            ).all()
        for r in rows:
            rec = _replica(r)
            out.setdefault(rec.service, []).append(rec)
        return out

    def update_replica(
        self,
        rec: ReplicaRecord,
        now: float,
        message: str | None = None,
        **changes: Unpack[ReplicaChanges],
    ) -> ReplicaRecord:
        """Write `changes` (columns, checked by mypy: ReplicaChanges) to the replica's row; a
        status change is recorded as an event."""
        values = _row_values(changes, _REPLICA_COLUMNS, "replica")
        new_status = changes.get("status")
        cause = changes.get("termination_cause")
        if cause is not None:  # a word the column does not know fails before the write
            values["termination_cause"] = TerminationCause(cause).value
        with self._write() as conn:
            conn.execute(
                update(t.replicas)
                .where(
                    t.replicas.c.service == rec.service,
                    t.replicas.c.replica_id == rec.replica_id,
                )
                .values(updated_at=now, **values)
            )
            if new_status is not None and new_status != rec.status:
                text = message or changes.get("reason") or f"status {new_status}"
                self._event(
                    conn,
                    rec.service,
                    now,
                    "replica",
                    str(text),
                    rec.replica_id,
                    rec.status.value,
                    str(values["status"]),
                )
            elif message:
                self._event(conn, rec.service, now, "replica", message, rec.replica_id)
        fields: dict[str, Any] = {k: v for k, v in changes.items() if k != "status"}
        status = ReplicaStatus(values["status"]) if "status" in values else rec.status
        if cause is not None:
            fields["termination_cause"] = TerminationCause(cause)
        new = dataclasses.replace(rec, status=status, updated_at=now, **fields)
        if status is not rec.status:
            self._tell(rec.status, new)
        return new

    def _tell(self, old: ReplicaStatus | None, rec: ReplicaRecord) -> None:
        """Tell the listeners of a committed status change; a failing one never fails it."""
        for listener in self.replica_listeners:
            try:
                listener(old, rec)
            except Exception:
                log.exception("a replica listener failed")

    def delete_replica(self, service: str, replica_id: ReplicaId, now: float, message: str) -> None:
        with self._write() as conn:
            conn.execute(
                delete(t.replicas).where(
                    t.replicas.c.service == service, t.replicas.c.replica_id == replica_id
                )
            )
            self._event(conn, service, now, "replica", message, replica_id)

    # -- events and policy state ---------------------------------------------------------

    def _event(
        self,
        conn: Connection,
        service: str,
        now: float,
        kind: str,
        message: str,
        replica_id: ReplicaId | None = None,
        status_from: str | None = None,
        status_to: str | None = None,
    ) -> None:
        self._serialize(conn)
        conn.execute(
            insert(t.events).values(
                service=service,
                replica_id=replica_id,
                at=now,
                kind=kind,
                status_from=status_from,
                status_to=status_to,
                message=message,
            )
        )

    def _serialize(self, conn: Connection) -> None:
        """PostgreSQL: hold the write-order lock until this transaction ends, so that events
        (and a launch's job ids) commit in the order of their ids, as on SQLite; a follower
        of `list_events(after=ID)` then never skips one committed late under a lower id.
        Taken last in a write (`_event`), or first by one that waits for no row lock after
        it (`add_jobs`), so it never closes a cycle of waits."""
        if self.postgres:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_WRITE_ORDER_LOCK})

    def add_event(
        self, service: str, now: float, kind: str, message: str, replica_id: ReplicaId | None = None
    ) -> None:
        with self._write() as conn:
            self._event(conn, service, now, kind, message, replica_id)

    def list_events(
        self, service: str, limit: int = 50, after: int | None = None
    ) -> list[EventRecord]:
        """The newest `limit` events, oldest first; with `after`, the first `limit` events
        whose id is above it (oldest first), so that a follower sees each event once."""
        query = select(t.events).where(t.events.c.service == service)
        with self.engine.connect() as conn:
            if after is not None:
                if self.postgres and after >= _PG_INT_MAX:  # the API takes any 64-bit id
                    return []
                rows = conn.execute(
                    query.where(t.events.c.id > after).order_by(t.events.c.id).limit(limit)
                ).all()
                return [EventRecord(**r._mapping) for r in rows]
            rows = conn.execute(query.order_by(t.events.c.id.desc()).limit(limit)).all()
        return [EventRecord(**r._mapping) for r in reversed(rows)]

    def get_policy_state(self, service: str, policy: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            raw = conn.execute(
                select(t.policy_state.c.state_json).where(
                    t.policy_state.c.service == service, t.policy_state.c.policy == policy
                )
            ).scalar_one_or_none()
        return None if raw is None else dict(json.loads(raw))

    def policy_states(self, policy: str) -> dict[str, dict[str, Any]]:
        """One policy's state of every service that has one, in one read."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.policy_state.c.service, t.policy_state.c.state_json).where(
                    t.policy_state.c.policy == policy
                )
            ).all()
        return {str(service): dict(json.loads(raw)) for service, raw in rows}

    def put_policy_state(
        self, service: str, policy: str, state: dict[str, Any], now: float
    ) -> None:
        payload = json.dumps(state, sort_keys=True)
        for attempt in range(2):
            try:
                with self._write() as conn:
                    done = conn.execute(
                        update(t.policy_state)
                        .where(
                            t.policy_state.c.service == service, t.policy_state.c.policy == policy
                        )
                        .values(state_json=payload, updated_at=now)
                    )
                    if done.rowcount == 0:
                        conn.execute(
                            insert(t.policy_state).values(
                                service=service, policy=policy, state_json=payload, updated_at=now
                            )
                        )
                return
            except IntegrityError:  # another writer inserted it meanwhile: update that row
                if attempt:
                    raise

    # -- jobs (worker pools) ----------------------------------------------------------------

    def add_jobs(
        self,
        pool: str,
        name: str | None,
        run: str,
        envs: dict[str, str],
        num_jobs: int,
        slots: float,
        tokens: list[str],
        now: float,
    ) -> list[JobRecord]:
        """Queue `num_jobs` jobs (ranks 0..num_jobs-1) in one transaction: all or none."""
        if not 1 <= num_jobs <= MAX_JOBS_PER_LAUNCH or len(tokens) != num_jobs:
            raise ValueError(f"num_jobs must be within 1..{MAX_JOBS_PER_LAUNCH}")
        envs_json = json.dumps(envs, sort_keys=True)
        ids: list[int] = []
        with self._write() as conn:
            self._serialize(conn)  # PostgreSQL: one launch's ids in a row, never interleaved
            if (
                conn.execute(select(t.services.c.name).where(t.services.c.name == pool)).first()
                is None
            ):
                raise NotFound(f"no pool called {pool!r}")
            for rank in range(num_jobs):
                result = conn.execute(
                    insert(t.jobs).values(
                        pool=pool,
                        name=name,
                        batch=ids[0] if ids else 0,
                        rank=rank,
                        num_jobs=num_jobs,
                        status=JobStatus.PENDING.value,
                        run=run,
                        envs_json=envs_json,
                        slots=slots,
                        launch_token=tokens[rank],
                        attempts=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
                pk = result.inserted_primary_key
                assert pk is not None
                job_id = int(pk[0])
                ids.append(job_id)
            conn.execute(update(t.jobs).where(t.jobs.c.job_id.in_(ids)).values(batch=ids[0]))
            what = f"{num_jobs} jobs queued" if num_jobs > 1 else "job queued"
            span = f"{ids[0]}-{ids[-1]}" if num_jobs > 1 else str(ids[0])
            self._event(conn, pool, now, "jobs", f"{what} (ids {span})")
        return self.list_jobs(pool=pool, ids=ids)

    def list_jobs(
        self,
        pool: str | None = None,
        ids: list[int] | None = None,
        statuses: tuple[JobStatus, ...] | None = None,
        limit: int | None = None,
        first: int | None = None,
    ) -> list[JobRecord]:
        """Jobs by id; `limit`: the newest ones only, `first`: the oldest ones only."""
        q = select(t.jobs)
        if pool is not None:
            q = q.where(t.jobs.c.pool == pool)
        if ids is not None:
            q = q.where(t.jobs.c.job_id.in_(ids))
        if statuses is not None:
            q = q.where(t.jobs.c.status.in_([s.value for s in statuses]))
        q = q.order_by(t.jobs.c.job_id)
        if limit is not None:
            q = q.order_by(None).order_by(t.jobs.c.job_id.desc()).limit(limit)
        elif first is not None:
            q = q.limit(first)
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        jobs = [_job(r) for r in rows]
        return sorted(jobs, key=lambda j: j.job_id)

    def get_job(self, job_id: int) -> JobRecord:
        with self.engine.connect() as conn:
            row = conn.execute(select(t.jobs).where(t.jobs.c.job_id == job_id)).first()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return _job(row)

    def update_job(
        self,
        job: JobRecord,
        now: float,
        expect: JobStatus | None = None,
        **changes: Unpack[JobChanges],
    ) -> JobRecord | None:
        """Write `changes` (columns, checked by mypy: JobChanges); with `expect`, only if the
        job is still in that status (a cancel and a finish racing: the first one wins).
        Returns the new record, or None."""
        values = _row_values(changes, _JOB_COLUMNS, "job")
        status = changes.get("status")
        q = update(t.jobs).where(t.jobs.c.job_id == job.job_id)
        if expect is not None:
            q = q.where(t.jobs.c.status == expect.value)
        with self._write() as conn:
            done = conn.execute(q.values(updated_at=now, **values))
            if done.rowcount == 0:
                return None
            pool_exists = conn.execute(
                select(t.services.c.name).where(t.services.c.name == job.pool)
            ).first()
            if (
                status is not None
                and JobStatus(changes["status"]) is not job.status
                and pool_exists is not None  # a job outlives its pool; its events do not
            ):
                text_ = changes.get("reason") or f"job {job.job_id} {changes['status']}"
                self._event(
                    conn, job.pool, now, "job", f"job {job.job_id} (rank {job.rank}): {text_}"
                )
        fields: dict[str, Any] = {k: v for k, v in changes.items() if k != "status"}
        new_status = JobStatus(changes["status"]) if "status" in changes else job.status
        return dataclasses.replace(job, status=new_status, updated_at=now, **fields)

    def job_counts(self, pool: str, min_slots: float = 0.0) -> tuple[int, float, float]:
        """(queued jobs, their slots, running jobs' slots) of a pool, counted by the database;
        a job counts for at least `min_slots` (jobs stored with less before that floor)."""
        from sqlalchemy import case, func

        slots = case((t.jobs.c.slots < min_slots, min_slots), else_=t.jobs.c.slots)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.jobs.c.status, func.count(), func.coalesce(func.sum(slots), 0))
                .where(
                    t.jobs.c.pool == pool,
                    t.jobs.c.status.in_([JobStatus.PENDING.value, JobStatus.RUNNING.value]),
                )
                .group_by(t.jobs.c.status)
            ).all()
        by = {str(r[0]): (int(r[1]), float(r[2])) for r in rows}
        queued, queued_slots = by.get(JobStatus.PENDING.value, (0, 0.0))
        return queued, queued_slots, by.get(JobStatus.RUNNING.value, (0, 0.0))[1]
