"""What a reconcile round spends on a fleet at rest: it reads a fixed fleet's load report only
when the dashboard's history takes a point (an autoscaled fleet's every round), and a probe
that passes on a READY replica wakes no round. Behaviour, not speed (bench/controller)."""

from __future__ import annotations

import httpx

from fleetserve.controller.probe_client import HttpxProbes
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import rows_after
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord, TerminationCause
from fleetserve.policies.fleet import Action, CreateReplicas, SetStatus, Terminate, routable
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, service_yaml
from .test_reconciler import ProbeAnswers, make_reconciler, run_rounds

AUTOSCALED = """\
service:
  readiness_probe: {path: /health, initial_delay_seconds: 1200}
  replica_policy: {min_replicas: 1, max_replicas: 3, target_qps_per_replica: 5}
run: python3 server.py
"""


async def test_a_fixed_fleet_reads_its_load_report_once_per_history_step(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        create_service(store, "good", service_yaml(replicas=2), clock.now())
        create_service(store, "auto", AUTOSCALED, clock.now())
        fixed = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        scaled = make_reconciler("auto", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [fixed, scaled], rounds=40)  # 10 s, ready after the first
        assert [r.status for r in store.list_replicas("good")] == [ReplicaStatus.READY] * 2
        lb.loads.clear()
        await run_rounds(clock, [fixed, scaled], rounds=80)  # 20 s: 4 history steps of 5 s
    assert 4 <= lb.loads.count("good") <= 5
    assert lb.loads.count("auto") == 80


async def test_a_ready_replica_that_passes_its_probes_wakes_no_round(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        create_service(store, "good", service_yaml(replicas=2), clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=40)
        assert [r.status for r in store.list_replicas("good")] == [ReplicaStatus.READY] * 2
        rec.wake.clear()
        for _ in range(10):  # 25 s of rounds: READY replicas probed every 5 s, all passing
            await run_rounds(clock, [rec], rounds=10)
            assert not rec.wake.is_set()

    def broken(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(500)

    # A failing probe still wakes it: NOT_READY at once, out of the LB's set.
    async with httpx.AsyncClient(transport=httpx.MockTransport(broken)) as client:
        rec.prober.client = client
        rec.prober.transport = HttpxProbes(client)
        await run_rounds(clock, [rec], rounds=24)  # the next probes (every 5 s) fail
        assert rec.wake.is_set()
    assert [r.status for r in store.list_replicas("good")] == [ReplicaStatus.NOT_READY] * 2


def test_the_routable_set_is_pushed_from_the_rows_as_the_rounds_actions_left_them() -> None:
    """`rows_after`: a round pushes the set from the rows it read and its own actions, not
    from a second read of every row."""
    rows = [
        ReplicaRecord("s", i, 1, status, endpoint=f"http://h:{i}")
        for i, status in enumerate(
            [ReplicaStatus.READY, ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.READY],
            start=1,
        )
    ]
    actions: list[Action] = [
        SetStatus(1, ReplicaStatus.NOT_READY, "probe failed"),
        SetStatus(2, ReplicaStatus.READY, None),
        Terminate(3, ReplicaStatus.READY, "scaled down", TerminationCause.SCALE_DOWN, drain=True),
        CreateReplicas(2),
    ]
    after = rows_after(actions, rows)
    assert [(r.replica_id, r.status) for r in after] == [
        (1, ReplicaStatus.NOT_READY),
        (2, ReplicaStatus.READY),
        (4, ReplicaStatus.READY),
    ]
    assert [r.replica_id for r in routable(after, {1})] == [2, 4]
