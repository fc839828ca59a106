"""`Store`: the only code that reads and writes the database.

SQLite in WAL mode under FLEETSERVE_HOME by default; any SQLAlchemy URL works. The schema is
created and upgraded by Alembic when the store opens. Methods return frozen records.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, delete, event, insert, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from fleetserve.core.errors import Conflict, NotFound
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import (
    EventRecord,
    ReplicaRecord,
    ServicePhase,
    ServiceRecord,
    VersionRecord,
)
from fleetserve.store import tables as t

_MIGRATIONS = Path(__file__).parent / "migrations"
_REPLICA_COLUMNS = {c.name for c in t.replicas.columns} - {"service", "replica_id"}
_SERVICE_COLUMNS = {c.name for c in t.services.columns} - {"name"}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _replica(row: Row[Any]) -> ReplicaRecord:
    m = dict(row._mapping)
    m["status"] = ReplicaStatus(m["status"])
    return ReplicaRecord(**m)


def _service(row: Row[Any]) -> ServiceRecord:
    m = dict(row._mapping)
    m["phase"] = ServicePhase(m["phase"])
    return ServiceRecord(**m)


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, future=True)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._migrate()

    @classmethod
    def at_path(cls, path: Path) -> Store:
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{path}")

    def _migrate(self) -> None:
        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        self.engine.dispose()

    # -- services ------------------------------------------------------------------------

    def create_service(
        self, name: str, yaml_text: str, spec_json: str, now: float
    ) -> ServiceRecord:
        try:
            with self.engine.begin() as conn:
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

    def update_service(self, name: str, now: float, **changes: Any) -> ServiceRecord:
        unknown = set(changes) - _SERVICE_COLUMNS
        if unknown:
            raise ValueError(f"not service columns: {sorted(unknown)}")
        if isinstance(changes.get("phase"), ServicePhase):
            changes["phase"] = changes["phase"].value
        with self.engine.begin() as conn:
            conn.execute(
                update(t.services)
                .where(t.services.c.name == name)
                .values(updated_at=now, **changes)
            )
        return self.service(name)

    def delete_service(self, name: str) -> None:
        with self.engine.begin() as conn:
            for table in (t.policy_state, t.events, t.replicas, t.versions):
                conn.execute(delete(table).where(table.c.service == name))
            conn.execute(delete(t.services).where(t.services.c.name == name))

    def add_version(self, service: str, yaml_text: str, spec_json: str, now: float) -> int:
        """Store a new version of the service's spec; returns its number."""
        with self.engine.begin() as conn:
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
        self, service: str, version: int, infra: str, token: str, now: float
    ) -> ReplicaRecord:
        """Take the next replica id (never reused) and write its PENDING row, atomically."""
        with self.engine.begin() as conn:
            next_id = conn.execute(
                select(t.services.c.next_replica_id).where(t.services.c.name == service)
            ).scalar_one()
            conn.execute(
                update(t.services)
                .where(t.services.c.name == service)
                .values(next_replica_id=next_id + 1, updated_at=now)
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
                    scale_down=False,
                    purge=False,
                )
            )
            self._event(conn, service, now, "replica", "replica created", next_id, None, "PENDING")
        return self.replica(service, next_id)

    def get_replica(self, service: str, replica_id: int) -> ReplicaRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(t.replicas).where(
                    t.replicas.c.service == service, t.replicas.c.replica_id == replica_id
                )
            ).first()
        return _replica(row) if row else None

    def replica(self, service: str, replica_id: int) -> ReplicaRecord:
        rec = self.get_replica(service, replica_id)
        if rec is None:
            raise NotFound(f"service {service!r} has no replica {replica_id}")
        return rec

    def list_replicas(self, service: str) -> list[ReplicaRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.replicas)
                .where(t.replicas.c.service == service)
                .order_by(t.replicas.c.replica_id)
            ).all()
        return [_replica(r) for r in rows]

    def update_replica(
        self, rec: ReplicaRecord, now: float, message: str | None = None, **changes: Any
    ) -> ReplicaRecord:
        """Write `changes` to the replica's row; a status change is recorded as an event."""
        unknown = set(changes) - _REPLICA_COLUMNS
        if unknown:
            raise ValueError(f"not replica columns: {sorted(unknown)}")
        new_status = changes.get("status")
        if isinstance(new_status, ReplicaStatus):
            changes["status"] = new_status.value
        with self.engine.begin() as conn:
            conn.execute(
                update(t.replicas)
                .where(
                    t.replicas.c.service == rec.service,
                    t.replicas.c.replica_id == rec.replica_id,
                )
                .values(updated_at=now, **changes)
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
                    str(changes["status"]),
                )
            elif message:
                self._event(conn, rec.service, now, "replica", message, rec.replica_id)
        fields = {k: v for k, v in changes.items() if k != "status"}
        status = ReplicaStatus(changes["status"]) if "status" in changes else rec.status
        return dataclasses.replace(rec, status=status, updated_at=now, **fields)

    def delete_replica(self, service: str, replica_id: int, now: float, message: str) -> None:
        with self.engine.begin() as conn:
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
        replica_id: int | None = None,
        status_from: str | None = None,
        status_to: str | None = None,
    ) -> None:
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

    def add_event(
        self, service: str, now: float, kind: str, message: str, replica_id: int | None = None
    ) -> None:
        with self.engine.begin() as conn:
            self._event(conn, service, now, kind, message, replica_id)

    def list_events(self, service: str, limit: int = 50) -> list[EventRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.events)
                .where(t.events.c.service == service)
                .order_by(t.events.c.id.desc())
                .limit(limit)
            ).all()
        return [EventRecord(**r._mapping) for r in reversed(rows)]

    def get_policy_state(self, service: str, policy: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            raw = conn.execute(
                select(t.policy_state.c.state_json).where(
                    t.policy_state.c.service == service, t.policy_state.c.policy == policy
                )
            ).scalar_one_or_none()
        return None if raw is None else dict(json.loads(raw))

    def put_policy_state(
        self, service: str, policy: str, state: dict[str, Any], now: float
    ) -> None:
        payload = json.dumps(state, sort_keys=True)
        with self.engine.begin() as conn:
            done = conn.execute(
                update(t.policy_state)
                .where(t.policy_state.c.service == service, t.policy_state.c.policy == policy)
                .values(state_json=payload, updated_at=now)
            )
            if done.rowcount == 0:
                conn.execute(
                    insert(t.policy_state).values(
                        service=service, policy=policy, state_json=payload, updated_at=now
                    )
                )
