"""`fleetserve down NAME --replica-id N [--purge]` (Controller.terminate_replica): a teardown
that fails keeps the replica's row in FAILED_CLEANUP unless the user asked to purge it; a
purge removes it even then, and touches no other service's replica of the same id. On the
fake infra and LB, a fake clock, a store on SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import cast

from fleetserve.controller.controller import Controller
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus

from .fakes import FakeInfra, FakeLb, create_service, handle_of, service_yaml


async def until(what: str, test: Callable[[], bool]) -> None:
    for _ in range(200):  # bounded: 10 s
        if test():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_purge_removes_a_replica_whose_teardown_fails(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", reconcile_interval=0.05)
    settings.home.mkdir(mode=0o700)
    clock = FakeClock()
    infra = FakeInfra()
    ctl = Controller(settings, clock=clock, infra=infra)
    ctl.lb = cast(LbManager, FakeLb())

    def row(service: str) -> ReplicaStatus | None:
        rec = ctl.store.get_replica(service, 1)
        return None if rec is None else rec.status

    async def scenario() -> None:
        for name in ("web", "other"):
            create_service(ctl.store, name, service_yaml(replicas=1), clock.now())
            ctl._run(name)
        await until(
            "both services' replica 1 launched",
            lambda: all(
                (r := ctl.store.get_replica(n, 1)) is not None and r.handle is not None
                for n in ("web", "other")
            ),
        )
        infra.terminate_error = RuntimeError("the instance API timed out")
        # Without --purge: the row stays, in FAILED_CLEANUP, saying why.
        ctl.terminate_replica("web", 1)
        await until("FAILED_CLEANUP", lambda: row("web") is ReplicaStatus.FAILED_CLEANUP)
        reason = ctl.store.replica("web", 1).reason or ""
        assert "teardown failed: the instance API timed out" in reason
        # Asked again without --purge: tried again, the row still stays.
        tries = len(infra.terminated)
        ctl.terminate_replica("web", 1)
        await until("the teardown tried again", lambda: len(infra.terminated) > tries)
        await until("FAILED_CLEANUP again", lambda: row("web") is ReplicaStatus.FAILED_CLEANUP)
        # With --purge: tried once more and, failing, the row goes all the same.
        ctl.terminate_replica("web", 1, purge=True)
        await until("the row purged", lambda: row("web") is None)
        events = [e.message for e in ctl.store.list_events("web", 100) if e.replica_id == 1]
        assert any("replica row purged" in m and "teardown failed" in m for m in events)
        # The other service's replica 1 was never touched.
        assert handle_of("other", 1) not in {h for h, _ in infra.terminated}
        assert row("other") is not None and row("other") is not ReplicaStatus.FAILED_CLEANUP
        await ctl._stop_reconcilers()

    try:
        asyncio.run(scenario())
    finally:
        ctl.store.close()
