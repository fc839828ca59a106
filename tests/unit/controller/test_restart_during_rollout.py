"""A controller killed during a rolling update (chaos seed 489481, issue #28), on a fake infra,
a fake LB and the fake clock: the restarted controller finishes the interrupted rollout; an
update sent while it is still rolling out is refused and changes nothing (the chaos test had
counted it as accepted, and waited 180 s for a size the controller was never told); the same
update sent once the rollout is over is accepted and the fleet converges to it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import httpx
import pytest

from fleetserve.controller import updates
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import ServiceReconciler
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.errors import Conflict
from fleetserve.core.status import ReplicaStatus
from fleetserve.spec.loader import parse_spec
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, settle

ROUND = 0.25  # seconds of fake time between two rounds


def spec_yaml(replicas: int, generation: int) -> str:
    """The chaos test's service: a new GENERATION is a new task (a rolling update, not a
    move in place)."""
    return (
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 30\n"
        f"  replicas: {replicas}\n"
        "run: python3 server.py\n"
        "envs:\n"
        f'  GENERATION: "{generation}"\n'
    )


def update(store: Store, clock: FakeClock, yaml_text: str) -> None:
    svc = store.service("alpha")
    current = parse_spec(store.version("alpha", svc.active_version).yaml_text)
    updates.apply_update(
        store, svc, current, yaml_text, Path.cwd(), "rolling", None, "local", clock.now()
    )


def fleet(store: Store) -> list[tuple[int, int, ReplicaStatus]]:
    return [(r.replica_id, r.version, r.status) for r in store.list_replicas("alpha")]


async def rounds(clock: FakeClock, rec: ServiceReconciler, n: int) -> None:
    for _ in range(n):
        clock.advance(ROUND)
        await rec.reconcile_once()
        await settle()


async def test_an_update_sent_while_a_restarted_controller_finishes_a_rollout_is_refused(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = FakeInfra(), FakeLb()
    ok = httpx.MockTransport(lambda _request: httpx.Response(200))
    async with httpx.AsyncClient(transport=ok) as client:

        def controller() -> ServiceReconciler:
            return ServiceReconciler(
                "alpha", store, infra, cast(LbManager, lb), Prober(client), settings, clock
            )

        create_service(store, "alpha", spec_yaml(2, generation=1), clock.now())
        first = controller()
        await rounds(clock, first, 8)
        assert fleet(store) == [(1, 1, ReplicaStatus.READY), (2, 1, ReplicaStatus.READY)]

        # Round 6 of seed 489481: an update, and kill -9 while its first new replica launches.
        update(store, clock, spec_yaml(2, generation=7))
        infra.gate = asyncio.Event()  # launches hang until the controller dies
        await rounds(clock, first, 2)
        assert (3, 2, ReplicaStatus.PROVISIONING) in fleet(store)
        await first.executor.cancel_all()  # the process is gone: no cleanup ran
        first.prober.close()
        infra.gate = None

        # Round 7: the controller is back, adopting and relaunching; a scale to 3 arrives
        # before the interrupted rollout has ended: refused, and nothing stored.
        second = controller()
        await second.recover()
        assert store.service("alpha").rolling_out
        with pytest.raises(Conflict, match="still rolling out version 2"):
            update(store, clock, spec_yaml(3, generation=8))
        assert store.service("alpha").active_version == 2

        # The fleet converges to what the controller accepted: version 2, two replicas.
        await rounds(clock, second, 12)
        svc = store.service("alpha")
        assert (svc.active_version, svc.serving_version, svc.rolling_out) == (2, 2, False)
        assert [(v, s) for _, v, s in fleet(store)] == [(2, ReplicaStatus.READY)] * 2

        # The same scale once the rollout is over: accepted, and the fleet grows to it.
        update(store, clock, spec_yaml(3, generation=8))
        await rounds(clock, second, 16)
        svc = store.service("alpha")
        assert (svc.active_version, svc.serving_version, svc.rolling_out) == (3, 3, False)
        assert [(v, s) for _, v, s in fleet(store)] == [(3, ReplicaStatus.READY)] * 3
        await second.stop()


async def test_an_update_over_a_failed_rollout_replaces_it_from_the_serving_version(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """A version that stopped launching (every launch failed) ends its rollout: an update
    with a fixed YAML is taken (it was refused as "still rolling out", with advice that did
    not help) and rolls out from the version that kept serving."""
    infra, lb = FakeInfra(), FakeLb()
    ok = httpx.MockTransport(lambda _request: httpx.Response(200))
    async with httpx.AsyncClient(transport=ok) as client:
        rec = ServiceReconciler(
            "alpha", store, infra, cast(LbManager, lb), Prober(client), settings, clock
        )
        create_service(store, "alpha", spec_yaml(2, generation=1), clock.now())
        await rounds(clock, rec, 8)
        infra.always = RuntimeError("image not found")  # version 2 cannot launch
        update(store, clock, spec_yaml(2, generation=2))
        for _ in range(200):
            await rounds(clock, rec, 1)
            if store.service("alpha").launch_stop:
                break
        svc = store.service("alpha")
        assert svc.launch_stop and svc.rolling_out and svc.serving_version == 1
        infra.always = None
        update(store, clock, spec_yaml(2, generation=3))  # the fix
        svc = store.service("alpha")
        assert (svc.active_version, svc.serving_version, svc.launch_stop) == (3, 1, None)
        await rounds(clock, rec, 16)
        svc = store.service("alpha")
        assert (svc.active_version, svc.serving_version, svc.rolling_out) == (3, 3, False)
        ready = [(v, s) for _, v, s in fleet(store) if s is ReplicaStatus.READY]
        assert ready == [(3, ReplicaStatus.READY)] * 2
        assert any(
            "version 2 failed and is dropped" in e.message for e in store.list_events("alpha")
        )
        await rec.stop()
