"""The typed change sets (core.types: ReplicaChanges, ServiceChanges, JobChanges) that the
store's writers take: each names exactly its table's writable columns, so that mypy's check of
a write is a check against the schema; a name outside them is refused before any write."""

from __future__ import annotations

import pytest

from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import JobChanges, ReplicaChanges, ServiceChanges
from fleetserve.store import Store
from fleetserve.store import tables as t


@pytest.mark.parametrize(
    ("changes", "table", "key"),
    [
        (ReplicaChanges, t.replicas, {"service", "replica_id"}),
        (ServiceChanges, t.services, {"name"}),
        (JobChanges, t.jobs, {"job_id", "pool"}),
    ],
    ids=["replicas", "services", "jobs"],
)
def test_each_change_set_names_its_tables_writable_columns(
    changes: type, table: object, key: set[str]
) -> None:
    """All columns but the row's key and updated_at (every write sets it itself)."""
    columns = {c.name for c in table.columns} - key - {"updated_at"}  # type: ignore[attr-defined]
    assert set(changes.__annotations__) == columns
    assert not changes.__required_keys__  # type: ignore[attr-defined]  # any subset


def test_an_unknown_column_or_cause_is_refused_before_the_write(store: Store) -> None:
    store.create_service("a", "y", "{}", 1.0)
    rec = store.allocate_replica("a", 1, "local", "t", 2.0)
    with pytest.raises(ValueError, match="not service columns: \\['lb_prot'\\]"):
        store.update_service("a", 3.0, lb_prot=30001)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="'shrunk' is not a valid TerminationCause"):
        store.update_replica(
            rec,
            3.0,
            status=ReplicaStatus.SHUTTING_DOWN,
            termination_cause="shrunk",  # type: ignore[arg-type]
        )
    assert store.replica("a", rec.replica_id).status is ReplicaStatus.PENDING  # nothing was written
    assert store.service("a").lb_port is None
