"""A service whose replicas all fail before ever becoming READY, on the fake infra and clock:
launches stop after exactly the crash-loop limit, one event says so, and the reason carries
the cause from the replica's log with the command that shows the rest."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetserve.controller.prober import Prober
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.errors import TerminalError
from fleetserve.core.status import ReplicaStatus
from fleetserve.infra.base import InstanceKind, InstanceState, Launched, LaunchRequest
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, handle_of, service_yaml, settle
from .test_reconciler import ProbeAnswers, make_reconciler

CAUSE = "python3: can't open file '/srv/app/server.py': [Errno 2] No such file or directory"
LOG = ["[fleetserve] replica 1: starting run on port 4000\n", CAUSE + "\n"]


class CrashingInfra(FakeInfra):
    """Every replica's run exits with code 2 right after it starts (a missing file)."""

    async def launch(self, request: LaunchRequest) -> Launched:
        launched = await super().launch(request)
        handle = handle_of(request.service, request.replica_id)
        self.states[handle] = InstanceState(InstanceKind.EXITED, 2, "exited with code 2")
        self.log_lines[handle] = [*LOG, "[fleetserve] run exited with code 2\n"]
        return launched


async def rounds(clock: FakeClock, rec: object, n: int) -> None:
    for _ in range(n):
        clock.advance(0.25)
        await rec.reconcile_once()  # type: ignore[attr-defined]
        await settle()


@pytest.mark.parametrize("how", ["run-exits", "setup-fails"])
async def test_a_broken_service_launches_exactly_the_limit_and_says_why_once(
    store: Store, settings: Settings, clock: FakeClock, how: str
) -> None:
    if how == "run-exits":
        infra: FakeInfra = CrashingInfra()
    else:
        infra = FakeInfra()
        infra.always = TerminalError("setup failed with exit code 1 (see `fleetserve logs bad N`)")
        for i in range(1, 10):
            infra.log_lines[handle_of("bad", i)] = [*LOG, "[fleetserve] setup failed\n"]
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        create_service(store, "bad", service_yaml(replicas=2), clock.now())
        rec = make_reconciler("bad", store, infra, FakeLb(), Prober(client), settings, clock)
        await rounds(clock, rec, 40)
        await asyncio.sleep(0)

    # 2 replicas, each failing: one replacement, then launches stop at 3 (the limit), not 4.
    assert sorted(r.replica_id for r in infra.launches) == [1, 2, 3]
    replicas = store.list_replicas("bad")
    assert [r.replica_id for r in replicas] == [1, 2, 3]
    reason = store.service("bad").failure_reason or ""
    assert "launches stopped" in reason
    assert CAUSE in reason  # the cause, not only "exited with code 2"
    assert "[fleetserve]" not in reason  # the wrapper's own lines say nothing of the cause
    if how == "run-exits":
        assert "exited with code 2" in reason
        assert "`fleetserve logs bad 3 --no-follow` shows the rest" in reason
    else:
        assert reason.count("fleetserve logs") == 1  # the infra's own hint, not twice
    for r in replicas:
        assert r.reason is not None and CAUSE in r.reason
    stopped = [e for e in store.list_events("bad", 500) if "launches stopped" in e.message]
    assert len(stopped) == 1, [e.message for e in stopped]
    final = ReplicaStatus.FAILED if how == "run-exits" else ReplicaStatus.FAILED_PROVISION
    assert {r.status for r in replicas} == {final}
