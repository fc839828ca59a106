"""Spot services on a zoned fake infra: zones chosen by the placer, preemptions, full zones,
on-demand fallback and its retirement, and zone marks that survive a restart."""

from __future__ import annotations

import httpx
import pytest

from fleetserve.controller.prober import Prober
from fleetserve.controller.settings import Settings
from fleetserve.controller.spot import STATE_KEY
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord
from fleetserve.infra.base import InstanceKind, InstanceState, Launched, LaunchRequest, Location
from fleetserve.infra.zones import NoCapacity, ZoneBook, ZoneConfig
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, handle_of
from .test_reconciler import ProbeAnswers, make_reconciler, run_rounds

ZONES = ("zone-a", "zone-b", "zone-c")


class ZonedInfra(FakeInfra):
    """The fake infra with zones: a spot launch into a zone at capacity fails with
    NoCapacity; `preempt` loses a replica's instance."""

    def __init__(self, capacity: dict[str, int | None] | None = None) -> None:
        super().__init__()
        self.book = ZoneBook([ZoneConfig(z) for z in ZONES])
        for z, c in (capacity or {}).items():
            self.book.spot_capacity[z] = c
        self.held: dict[str, tuple[str, bool]] = {}  # handle -> (zone, spot)

    def locations(self) -> list[Location]:
        return [Location(zone=z, region="test", spot_capable=True, spot_price=1.0) for z in ZONES]

    async def launch(self, request: LaunchRequest) -> Launched:
        cap = self.book.spot_capacity.get(request.zone or "")
        held = sum(z == request.zone and s for z, s in self.held.values())
        if request.spot and cap is not None and held >= cap:
            self.launches.append(request)
            raise NoCapacity(f"no spot capacity in zone {request.zone}", request.zone or "")
        launched = await super().launch(request)
        zone = request.zone if request.spot else "od-zone"
        self.held[launched.handle] = (zone or "", request.spot)
        return Launched(launched.handle, launched.host, launched.port, zone=zone)

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        self.held.pop(handle or "", None)
        await super().terminate(handle, launch_token)

    def preempt(self, service: str, replica_id: int) -> None:
        handle = handle_of(service, replica_id)
        self.held.pop(handle, None)
        self.states[handle] = InstanceState(InstanceKind.LOST, None, "preempted")


def spot_yaml(replicas: int = 2, extra: int = 1, placer: str = "dynamic_fallback") -> str:
    return (
        "service:\n"
        "  readiness_probe: /health\n"
        "  replica_policy:\n"
        f"    min_replicas: {replicas}\n"
        f"    num_overprovision: {extra}\n"
        "    dynamic_ondemand_fallback: true\n"
        f"    spot_placer: {placer}\n"
        "resources:\n"
        "  use_spot: true\n"
        "run: python3 server.py\n"
    )


def alive(store: Store, name: str = "good") -> list[ReplicaRecord]:
    return [
        r
        for r in store.list_replicas(name)
        if not r.status.is_terminal and r.status is not ReplicaStatus.SHUTTING_DOWN
    ]


@pytest.mark.parametrize("placer", ["dynamic_fallback", "adaptive"])
async def test_spot_replicas_spread_over_zones_and_a_preempted_one_is_replaced_elsewhere(
    store: Store, settings: Settings, clock: FakeClock, placer: str
) -> None:
    infra, lb = ZonedInfra(), FakeLb()
    create_service(store, "good", spot_yaml(placer=placer), clock.now())
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=40)
        fleet = alive(store)
        # 2 wanted + 1 spare, all spot, READY, one per zone.
        assert [r.status for r in fleet] == [ReplicaStatus.READY] * 3
        assert all(r.spot for r in fleet)
        assert sorted(r.zone or "" for r in fleet) == list(ZONES)

        victim = fleet[0]
        infra.preempt("good", victim.replica_id)
        await run_rounds(clock, [rec], rounds=1)
        row = store.replica("good", victim.replica_id)
        assert row.status in (ReplicaStatus.SHUTTING_DOWN, ReplicaStatus.PREEMPTED)
        # Out of the LB set in that same round.
        assert victim.replica_id not in {e.replica_id for e in lb.last_push("good").endpoints}
        await run_rounds(clock, [rec], rounds=40)

    assert store.replica("good", victim.replica_id).status is ReplicaStatus.PREEMPTED
    fleet = alive(store)
    assert [r.status for r in fleet] == [ReplicaStatus.READY] * 3
    replacement = max(fleet, key=lambda r: r.replica_id)
    assert replacement.spot
    if placer == "dynamic_fallback":
        assert replacement.zone != victim.zone  # SkyServe's: a marked zone is avoided
    events = [e.message for e in store.list_events("good", limit=200)]
    assert any(f"preempted in zone {victim.zone}" in m for m in events)
    saved = store.get_policy_state("good", STATE_KEY)
    assert saved is not None and saved["placer"] == placer
    if placer == "dynamic_fallback":
        assert saved["state"]["preempted"] == [victim.zone]
    else:
        assert saved["state"]["risk"][victim.zone] > 0.5


async def test_a_lost_spot_replica_starts_an_on_demand_fallback_that_retires_once_spot_is_back(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = ZonedInfra(), FakeLb()
    create_service(store, "good", spot_yaml(replicas=2, extra=0), clock.now())
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=40)
        assert all(r.spot for r in alive(store)) and len(alive(store)) == 2
        infra.gate = __import__("asyncio").Event()  # spot replacements hang in launch
        infra.preempt("good", alive(store)[0].replica_id)
        await run_rounds(clock, [rec], rounds=3)
        kinds = sorted(r.spot for r in alive(store))
        # The lost spot replica: a spot replacement launching and an on-demand fallback.
        assert kinds == [False, True, True]
        infra.gate.set()
        infra.gate = None
        await run_rounds(clock, [rec], rounds=60)
    fleet = alive(store)
    assert len(fleet) == 2 and all(r.spot for r in fleet), fleet
    events = [e.message for e in store.list_events("good", limit=200)]
    assert any("on-demand fallback retired" in m for m in events)


async def test_a_full_zone_fails_the_launch_without_a_crash_loop_and_the_placer_moves_on(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = ZonedInfra({"zone-a": 0, "zone-b": 0}), FakeLb()
    create_service(store, "good", spot_yaml(replicas=2, extra=0), clock.now())
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=60)
    svc = store.get_service("good")
    assert svc is not None and svc.failure_reason is None  # no crash loop
    spot = [r for r in alive(store) if r.spot and r.status is ReplicaStatus.READY]
    assert spot and {r.zone for r in spot} == {"zone-c"}
    # The rest is READY, or PENDING while a full zone's back-off runs.
    assert all(r.status in (ReplicaStatus.READY, ReplicaStatus.PENDING) for r in alive(store))
    assert not any(r.status.is_failed for r in store.list_replicas("good"))
    tried = {q.zone for q in infra.launches if q.spot}
    assert {"zone-a", "zone-b"} & tried  # it did try a full zone, and heard it was full
    events = [e.message for e in store.list_events("good", limit=500)]
    assert any("no spot capacity in zone" in m for m in events)


async def test_zone_marks_survive_a_controller_restart(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = ZonedInfra(), FakeLb()
    create_service(store, "good", spot_yaml(), clock.now())
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=30)
        victim = alive(store)[1]
        infra.preempt("good", victim.replica_id)
        await run_rounds(clock, [rec], rounds=5)
        marks = rec.spot.placer.state() if rec.spot else None
        assert marks == {"preempted": [victim.zone]}
        # A new controller: the placer starts from the stored marks.
        again = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [again], rounds=1)
        assert again.spot is not None and again.spot.placer.state() == marks


async def test_no_capacity_anywhere_backs_off_instead_of_spinning(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    infra, lb = ZonedInfra({z: 0 for z in ZONES}), FakeLb()
    create_service(store, "good", spot_yaml(replicas=1, extra=0), clock.now())
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=240)  # 60 s of fake time
    tried = [q for q in infra.launches if q.spot]
    # 1, 2, 4, 8, 16 s apart (doubling to a minute): a handful, not one per round.
    assert 3 <= len(tried) <= 8, len(tried)
    assert any(not r.spot and r.status is ReplicaStatus.READY for r in alive(store))
