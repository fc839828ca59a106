"""`Executor`: launches with transient-error retries, terminations that cancel a launch, and
drains, on a fake infra and the fake clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetserve.controller.executor import TRANSIENT_RETRY_DELAYS, Executor
from fleetserve.core.clock import FakeClock
from fleetserve.core.errors import TerminalError, TransientError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord, TerminationCause
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.models import ServiceTask
from fleetserve.store import Store

from .fakes import FakeInfra, create_service, service_yaml, settle

SPEC: ServiceTask = parse_spec(service_yaml(replicas=1))


class Setup:
    def __init__(self, store: Store, clock: FakeClock, home: Path) -> None:
        self.store, self.clock, self.infra = store, clock, FakeInfra()
        self.changes = 0
        self.executor = Executor("svc", store, self.infra, clock, home, self._changed)
        create_service(store, "svc", service_yaml(replicas=1), clock.now())
        self.rec = store.allocate_replica("svc", 1, "fake", "token-1", clock.now())

    def _changed(self) -> None:
        self.changes += 1

    def row(self) -> ReplicaRecord:
        return self.store.replica("svc", 1)

    def messages(self) -> list[str]:
        return [e.message for e in self.store.list_events("svc", 100) if e.replica_id == 1]

    async def launched(self) -> ReplicaRecord:
        self.executor.launch(self.rec, SPEC)
        await self.executor.wait_idle()
        return self.row()


@pytest.fixture
def setup(store: Store, clock: FakeClock, tmp_path: Path) -> Setup:
    return Setup(store, clock, tmp_path)


def _transient() -> TransientError:
    return TransientError("cluster not up yet")


@pytest.mark.parametrize(
    ("errors", "always", "status", "launches", "waited"),
    [
        ([], None, ReplicaStatus.STARTING, 1, 0.0),
        ([_transient(), _transient()], None, ReplicaStatus.STARTING, 3, 1.0 + 2.0),
        (
            [],
            _transient(),
            ReplicaStatus.FAILED_PROVISION,
            len(TRANSIENT_RETRY_DELAYS) + 1,
            sum(TRANSIENT_RETRY_DELAYS),
        ),
        ([TerminalError("setup failed")], None, ReplicaStatus.FAILED_PROVISION, 1, 0.0),
    ],
    ids=["ok", "transient-twice", "always-transient", "terminal"],
)
async def test_launch_outcome(
    setup: Setup,
    errors: list[Exception],
    always: Exception | None,
    status: ReplicaStatus,
    launches: int,
    waited: float,
) -> None:
    setup.infra.errors, setup.infra.always = list(errors), always
    start = setup.clock.now()
    row = await setup.launched()
    assert row.status is status
    assert len(setup.infra.launches) == launches
    assert setup.clock.now() - start == pytest.approx(waited)
    retries = [m for m in setup.messages() if "retrying the launch" in m]
    assert retries == [
        f"cluster not up yet; retrying the launch in {d:g} s"
        for d in TRANSIENT_RETRY_DELAYS[: launches - 1]
    ]
    if status is ReplicaStatus.STARTING:
        assert (row.handle, row.endpoint) == ("svc/1", "http://svc-1.test:8000")
        assert row.started_at == setup.clock.now()
    else:
        assert row.reason == ("setup failed" if launches == 1 else "cluster not up yet")
        assert row.handle is None
    await settle()
    assert not setup.executor.busy(1) and setup.changes == 1


@pytest.mark.parametrize(
    ("cause", "final"),
    [(TerminationCause.SCALE_DOWN, None), (TerminationCause.FAILURE, ReplicaStatus.FAILED)],
    ids=["drop", "keep"],
)
async def test_terminate_during_launch_cancels_it_and_cleans_up_by_token(
    setup: Setup, cause: TerminationCause, final: ReplicaStatus | None
) -> None:
    setup.infra.gate = asyncio.Event()  # the launch never returns by itself
    setup.executor.launch(setup.rec, SPEC)
    await settle()
    assert setup.row().status is ReplicaStatus.PROVISIONING and setup.executor.busy(1)

    setup.executor.terminate(setup.row(), ReplicaStatus.PROVISIONING, "scaled down", cause)
    assert setup.row().status is ReplicaStatus.SHUTTING_DOWN
    assert setup.row().termination_cause is cause  # on the row, for a restarted controller
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)

    assert [r.replica_id for r in setup.infra.cancelled] == [1]
    assert setup.infra.terminated == [(None, "token-1")]
    row = setup.store.get_replica("svc", 1)
    assert (row.status if row else None) == final
    await settle()
    assert not setup.executor.busy(1)


async def test_terminate_without_drain_stops_at_once(setup: Setup) -> None:
    setup.executor.inflight_of = lambda _rid: 5
    row = await setup.launched()
    setup.executor.terminate(row, ReplicaStatus.READY, "terminated by user", TerminationCause.USER)
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)
    assert setup.infra.terminated == [("svc/1", "token-1")]
    assert setup.store.get_replica("svc", 1) is None


async def test_drain_waits_until_nothing_is_in_flight(setup: Setup) -> None:
    row = await setup.launched()
    start = setup.clock.now()
    # The LB reports requests in flight to the replica for 5 more seconds.
    setup.executor.inflight_of = lambda _rid: 2 if setup.clock.now() < start + 5 else 0
    setup.executor.terminate(
        row, ReplicaStatus.READY, "scaled down", TerminationCause.SCALE_DOWN, drain_seconds=120
    )
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=0.2)  # fake time: instant
    assert setup.infra.terminated == [("svc/1", "token-1")]
    assert 5 <= setup.clock.now() - start < 7


async def test_drain_is_bounded_by_drain_seconds(setup: Setup) -> None:
    row = await setup.launched()
    start = setup.clock.now()
    setup.executor.inflight_of = lambda _rid: 1  # a request that never ends
    setup.executor.terminate(
        row, ReplicaStatus.READY, "scaled down", TerminationCause.SCALE_DOWN, drain_seconds=120
    )
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=0.2)
    assert setup.infra.terminated == [("svc/1", "token-1")]
    assert 120 <= setup.clock.now() - start < 122


async def test_a_drain_under_way_ends_when_the_service_goes_down(setup: Setup) -> None:
    """`down` cuts drains short: the LB routes nothing more and its load is not read again,
    so a request in flight in its last report would otherwise hold the down for the whole
    drain (seen: `down` waited the 120 s default after a spot fallback's scale-down)."""
    row = await setup.launched()
    start = setup.clock.now()
    setup.executor.inflight_of = lambda _rid: 1  # the last report, never refreshed
    setup.executor.terminate(
        row, ReplicaStatus.READY, "scaled down", TerminationCause.SCALE_DOWN, drain_seconds=120
    )
    await asyncio.sleep(0)
    await setup.clock.sleep(10)
    setup.executor.cut_drains()
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=0.2)
    assert setup.infra.terminated == [("svc/1", "token-1")]
    assert setup.clock.now() - start < 12


async def test_a_failed_teardown_keeps_the_row_unless_it_is_purged(setup: Setup) -> None:
    """A teardown that fails leaves the row in FAILED_CLEANUP (the processes may live on);
    a termination with `purge` (`down NAME --replica-id N --purge`) removes the row all the
    same, with an event that says its teardown failed. The purge is written with
    SHUTTING_DOWN, in the same write."""
    row = await setup.launched()
    setup.infra.terminate_error = RuntimeError("the instance API timed out")
    setup.executor.terminate(row, ReplicaStatus.READY, "terminated by user", TerminationCause.USER)
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)
    kept = setup.row()
    assert kept.status is ReplicaStatus.FAILED_CLEANUP and not kept.purge
    assert "teardown failed: the instance API timed out" in (kept.reason or "")
    setup.infra.terminate_gate = asyncio.Event()
    setup.executor.terminate(
        kept, kept.status, "terminated by user", TerminationCause.USER, purge=True
    )
    await asyncio.sleep(0)
    during = setup.row()
    assert (during.status, during.purge) == (ReplicaStatus.SHUTTING_DOWN, True)
    setup.infra.terminate_gate.set()
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)
    assert setup.store.get_replica("svc", 1) is None
    assert any(
        "replica row purged" in m and "teardown failed: the instance API timed out" in m
        for m in setup.messages()
    )


@pytest.mark.parametrize("teardown_fails", [False, True], ids=["stopped", "teardown-failed"])
async def test_a_purge_asked_during_a_teardown_is_honoured(
    setup: Setup, teardown_fails: bool
) -> None:
    """A replica being stopped for a failure keeps its row (FAILED, for the crash-loop
    count), unless the user purges it while its teardown runs: then the row goes, whether
    the teardown succeeds or fails."""
    row = await setup.launched()
    setup.infra.terminate_gate = asyncio.Event()
    if teardown_fails:
        setup.infra.terminate_error = RuntimeError("no answer")
    setup.executor.terminate(row, ReplicaStatus.FAILED, "probe failed", TerminationCause.FAILURE)
    await asyncio.sleep(0)
    during = setup.row()
    assert during.status is ReplicaStatus.SHUTTING_DOWN and not during.purge
    setup.store.update_replica(during, setup.clock.now(), purge=True)  # what the API writes
    setup.infra.terminate_gate.set()
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)
    assert setup.store.get_replica("svc", 1) is None


async def test_a_failure_without_purge_keeps_its_row(setup: Setup) -> None:
    row = await setup.launched()
    setup.executor.terminate(row, ReplicaStatus.FAILED, "probe failed", TerminationCause.FAILURE)
    await asyncio.wait_for(setup.executor.wait_idle(), timeout=5)
    assert setup.row().status is ReplicaStatus.FAILED and not setup.row().purge
