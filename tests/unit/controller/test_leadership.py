"""Two controllers' lease loops on one database, on a fake clock: one active, the other a
standby that takes over when the active one dies (no release) or stops (release), and an
old leader that wakes up steps down instead of acting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetserve.controller.leadership import Leadership
from fleetserve.core.clock import FakeClock
from fleetserve.core.errors import Fenced
from fleetserve.store import Store


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    a, b = Store.at_path(tmp_path / "db.sqlite"), Store.at_path(tmp_path / "db.sqlite")
    yield a, b
    a.close()
    b.close()


class StepClock(FakeClock):
    """Moves only when the test says; the loops' sleeps just yield (a few real ms)."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0.002)


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def callbacks(self, who: str) -> tuple[object, object]:
        async def active() -> None:
            self.events.append(f"{who} active")

        async def lost() -> None:
            self.events.append(f"{who} standby")

        return active, lost


async def until(check: object, clock: StepClock, fake_seconds: float = 60) -> None:
    """Let the loops run until `check()` holds, at most `fake_seconds` of fake time."""
    start = clock.now()
    while clock.now() - start < fake_seconds:
        if callable(check) and check():
            return
        await asyncio.sleep(0.005)
        clock.advance(0.05)
    raise AssertionError("not reached")


async def test_one_active_the_other_takes_over_when_it_dies(stores: tuple[Store, Store]) -> None:
    clock = StepClock()
    a = Leadership(stores[0], clock, "http://127.0.0.1:1", ttl=6.0, holder="a")
    b = Leadership(stores[1], clock, "http://127.0.0.1:2", ttl=6.0, holder="b")
    log = Log()
    ta = asyncio.create_task(a.run(*log.callbacks("a")))  # type: ignore[arg-type]
    await until(lambda: a.active, clock)
    tb = asyncio.create_task(b.run(*log.callbacks("b")))  # type: ignore[arg-type]
    start = clock.now()
    await until(lambda: clock.now() - start > 30, clock, 40)  # a renews: b stays a standby
    assert a.active and not b.active and log.events == ["a active"]
    assert b.active_address() == "http://127.0.0.1:1"

    ta.cancel()  # a dies (kill -9): no release; b waits for the lease to expire
    died = clock.now()
    await until(lambda: b.active, clock)
    assert 0 < clock.now() - died <= 6.0 + 1.0 + 0.5
    assert stores[1].fence == ("b", 2) and log.events == ["a active", "b active"]

    # a was only paused: it wakes with its old lease, cannot renew, steps down, writes nothing
    with pytest.raises(Fenced):
        stores[0].add_event("web", clock.now(), "note", "stale")
    ta = asyncio.create_task(a.run(*log.callbacks("a")))  # type: ignore[arg-type]
    await until(lambda: "a standby" in log.events, clock)
    assert not a.active and b.active
    for t in (ta, tb):
        t.cancel()


async def test_a_clean_stop_hands_over_at_once(stores: tuple[Store, Store]) -> None:
    clock = StepClock()
    a = Leadership(stores[0], clock, "http://127.0.0.1:1", ttl=30.0, holder="a")
    b = Leadership(stores[1], clock, "http://127.0.0.1:2", ttl=30.0, holder="b")
    log = Log()
    ta = asyncio.create_task(a.run(*log.callbacks("a")))  # type: ignore[arg-type]
    await until(lambda: a.active, clock)
    tb = asyncio.create_task(b.run(*log.callbacks("b")))  # type: ignore[arg-type]
    ta.cancel()
    a.release()
    stopped = clock.now()
    await until(lambda: b.active, clock)
    assert clock.now() - stopped < 2.0  # not the 30 s of the lease
    tb.cancel()
