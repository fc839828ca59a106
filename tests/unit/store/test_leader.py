"""The active controller's lease in the store: taken when free or expired, renewed by its
holder only, a new generation at each change of holder, and every write of a controller that
lost it refused inside the write's own transaction (fencing)."""

from __future__ import annotations

import pytest

from fleetserve.core.errors import Fenced
from fleetserve.store import Store
from tests.unit.store.conftest import Backend

TTL = 6.0


@pytest.fixture
def two(backend: Backend) -> tuple[Store, Store]:
    """Two controllers' stores on one database (SQLite and PostgreSQL, conftest.py)."""
    return backend.open(), backend.open()


def test_the_first_takes_it_the_second_waits(two: tuple[Store, Store]) -> None:
    a, b = two
    lease = a.acquire_lease("a", "http://a", 100.0, TTL)
    assert lease is not None and lease.generation == 1
    assert b.acquire_lease("b", "http://b", 101.0, TTL) is None
    held = b.lease()
    assert held is not None and (held.holder, held.address) == ("a", "http://a")


def test_renewal_keeps_it_and_expiry_hands_it_over(two: tuple[Store, Store]) -> None:
    a, b = two
    a.acquire_lease("a", "http://a", 100.0, TTL)
    assert a.renew_lease("a", 1, 104.0, TTL)  # now good until 110
    assert b.acquire_lease("b", "http://b", 109.0, TTL) is None
    taken = b.acquire_lease("b", "http://b", 110.5, TTL)
    assert taken is not None and taken.generation == 2
    assert not a.renew_lease("a", 1, 111.0, TTL)  # too late: it is b's now
    again = b.acquire_lease("b", "http://b", 112.0, TTL)  # its holder re-taking it: a renewal
    assert again is not None and again.generation == 2


def test_a_released_lease_is_taken_at_once(two: tuple[Store, Store]) -> None:
    a, b = two
    a.acquire_lease("a", "http://a", 100.0, TTL)
    a.release_lease("a", 1, 101.0)
    taken = b.acquire_lease("b", "http://b", 101.5, TTL)
    assert taken is not None and taken.generation == 2
    a.release_lease("a", 1, 102.0)  # a stale release does nothing to b's lease
    assert not a.renew_lease("a", 1, 102.0, TTL)
    assert b.renew_lease("b", 2, 102.0, TTL)


def test_a_fenced_controller_writes_nothing(two: tuple[Store, Store]) -> None:
    a, b = two
    a.acquire_lease("a", "http://a", 100.0, TTL)
    a.fence = ("a", 1)
    a.create_service("web", "run: x", "{}", 100.0)  # the holder writes
    # a is paused past its lease; b takes over and fences its own writes
    b.acquire_lease("b", "http://b", 200.0, TTL)
    b.fence = ("b", 2)
    with pytest.raises(Fenced, match="lost its lease"):
        a.add_event("web", 201.0, "note", "from the old leader")
    with pytest.raises(Fenced):
        a.update_service("web", 201.0, launch_stop="stale")
    assert [e.message for e in a.list_events("web")] == ["service created (version 1)"]
    b.add_event("web", 202.0, "note", "from the new leader")
    assert b.list_events("web")[-1].message == "from the new leader"
    assert a.get_service("web") is not None  # reads go on


def test_without_a_fence_nothing_is_checked(two: tuple[Store, Store]) -> None:
    a, _ = two
    a.create_service("web", "run: x", "{}", 100.0)  # no lease row at all: the only controller
    assert a.lease() is None
