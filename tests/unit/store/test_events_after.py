"""Following a service's events: `list_events(after=ID)` gives each event once, in order."""

from __future__ import annotations

from fleetserve.store import Store


def test_events_after_an_id_are_the_next_ones_oldest_first_bounded_by_limit(
    store: Store,
) -> None:
    store.create_service("a", "y", "{}", 1.0)
    store.create_service("b", "y", "{}", 1.0)
    for i in range(5):
        store.add_event("a", 10.0 + i, "note", f"a{i}")
        store.add_event("b", 10.0 + i, "note", f"b{i}")
    everything = store.list_events("a", limit=100)
    ids = [e.id for e in everything]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and all(i > 0 for i in ids)
    newest = store.list_events("a", limit=2)  # without after: the newest, oldest first
    assert [e.message for e in newest] == ["a3", "a4"]
    seen, last = [], 0
    while batch := store.list_events("a", limit=2, after=last):
        assert len(batch) <= 2
        seen += [e.message for e in batch]
        last = batch[-1].id
    assert seen == [e.message for e in everything]  # each once, in order, none of b's
    assert store.list_events("a", limit=10, after=ids[-1]) == []
    assert store.list_events("a", limit=10, after=2**63 - 1) == []  # past PostgreSQL's INTEGER
    store.add_event("a", 20.0, "note", "new")
    assert [e.message for e in store.list_events("a", limit=10, after=ids[-1])] == ["new"]
    store.close()
