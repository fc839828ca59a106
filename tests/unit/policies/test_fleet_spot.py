"""`plan_fleet` for spot fleets: each kind brought to its count, on-demand fallbacks retired
as spot replicas come READY, and a rollout's new replicas filling the spot count first."""

from __future__ import annotations

from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord, TerminationCause
from fleetserve.policies.autoscaler import FallbackTargets, spot_split
from fleetserve.policies.fleet import CreateReplicas, FleetSettings, Terminate, plan_fleet
from fleetserve.spec.models import ReplicaPolicy

R, P = ReplicaStatus.READY, ReplicaStatus.PENDING
SCALE_DOWN = TerminationCause.SCALE_DOWN


def rec(rid: int, status: ReplicaStatus, spot: bool, version: int = 1) -> ReplicaRecord:
    return ReplicaRecord("s", rid, version, status, spot=spot, zone="z" if spot else None)


def settings(spot: int, od: int, version: int = 1) -> FleetSettings:
    return FleetSettings(
        target_replicas=spot + od,
        version=version,
        initial_delay_seconds=60,
        max_concurrent_launches=8,
        spot=FallbackTargets(spot=spot, on_demand=od),
    )


def creates(plan_actions: list[object]) -> list[tuple[int, bool]]:
    return [(a.count, a.spot) for a in plan_actions if isinstance(a, CreateReplicas)]


def test_each_kind_is_brought_to_its_count() -> None:
    plan = plan_fleet([rec(1, R, True)], {}, settings(spot=3, od=1), 0.0)
    assert creates(plan.actions) == [(2, True), (1, False)]


def test_an_on_demand_fallback_retires_once_spot_is_ready_again() -> None:
    fleet = [rec(1, R, True), rec(2, R, True), rec(3, R, False)]
    plan = plan_fleet(fleet, {}, settings(spot=2, od=0), 0.0)
    ends = [a for a in plan.actions if isinstance(a, Terminate)]
    assert [(t.replica_id, t.reason, t.cause) for t in ends] == [
        (3, "on-demand fallback retired: enough spot replicas are READY", SCALE_DOWN)
    ]
    assert creates(plan.actions) == []


def test_extra_spot_replicas_go_not_ready_first() -> None:
    fleet = [rec(1, R, True), rec(2, P, True), rec(3, R, True)]
    plan = plan_fleet(fleet, {}, settings(spot=2, od=0), 0.0)
    assert [a.replica_id for a in plan.actions if isinstance(a, Terminate)] == [2]


def test_a_rollout_fills_the_spot_count_first() -> None:
    fleet = [rec(1, R, True, version=1), rec(2, R, False, version=1)]
    plan = plan_fleet(fleet, {}, settings(spot=1, od=1, version=2), 0.0)
    assert creates(plan.actions) == [(1, True)]  # max_surge 1: one new replica, spot


def test_the_split_follows_skyserves_fallback_rule() -> None:
    rp = ReplicaPolicy(
        min_replicas=2, base_ondemand_fallback_replicas=1, dynamic_ondemand_fallback=True
    )
    # target 2 + 1 spare: 2 spot (3 - 1 base); on demand: 1 base + 1 per missing ready spot.
    assert spot_split(rp, 2, 1, 3, ready_spot=2) == FallbackTargets(spot=2, on_demand=1)
    assert spot_split(rp, 2, 1, 3, ready_spot=1) == FallbackTargets(spot=2, on_demand=2)
    assert spot_split(rp, 2, 1, 3, ready_spot=0) == FallbackTargets(spot=2, on_demand=2)
    # Counting only the target (fallback_basis without the spare): no fallback for a lost spare.
    no_base = ReplicaPolicy(min_replicas=2, dynamic_ondemand_fallback=True)
    assert spot_split(no_base, 2, 1, 2, ready_spot=2) == FallbackTargets(spot=3, on_demand=0)
    assert spot_split(no_base, 2, 1, 3, ready_spot=2) == FallbackTargets(spot=3, on_demand=1)
