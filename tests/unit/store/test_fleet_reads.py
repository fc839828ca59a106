"""The reads a listing of every service makes once for all of them (GET /services): every
service's replicas, and one policy's state of every service."""

from __future__ import annotations

from fleetserve.core.status import ReplicaStatus
from fleetserve.store import Store


def test_replicas_by_service_is_list_replicas_of_each(store: Store) -> None:
    for name in ("b", "a", "empty"):
        store.create_service(name, "yaml", "{}", 1.0)
    for name, count in (("a", 3), ("b", 2)):
        for i in range(count):
            store.allocate_replica(name, 1, "local", f"{name}-{i}", 2.0)
    store.update_replica(store.replica("a", 2), 3.0, status=ReplicaStatus.READY)
    store.delete_replica("a", 1, 4.0, "gone")
    grouped = store.replicas_by_service()
    assert set(grouped) == {"a", "b"}  # a service with no replica has no entry
    for name in ("a", "b"):
        assert grouped[name] == store.list_replicas(name)
    assert [r.replica_id for r in grouped["a"]] == [2, 3]
    assert grouped["a"][0].status is ReplicaStatus.READY


def test_policy_states_reads_one_policy_of_every_service(store: Store) -> None:
    for name in ("a", "b", "c"):
        store.create_service(name, "yaml", "{}", 1.0)
    store.put_policy_state("a", "autoscaler", {"target": 3}, 1.0)
    store.put_policy_state("b", "autoscaler", {"target": 5}, 1.0)
    store.put_policy_state("c", "pool", {"target": 1}, 1.0)
    assert store.policy_states("autoscaler") == {"a": {"target": 3}, "b": {"target": 5}}
    assert store.policy_states("pool") == {"c": {"target": 1}}
    assert store.policy_states("nothing") == {}
