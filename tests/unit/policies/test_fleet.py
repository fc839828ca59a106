"""The fleet planner on a fake clock: lifecycle steps, fleet size, launch limit, crash loops."""

from __future__ import annotations

import dataclasses

from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus as R
from fleetserve.core.types import ReplicaRecord, TerminationCause, deletes_row
from fleetserve.policies.fleet import (
    CreateReplicas,
    DeleteRow,
    FleetSettings,
    InstanceObservation,
    Observation,
    ProbeResult,
    SetStatus,
    StartLaunch,
    Terminate,
    plan_fleet,
    plan_shutdown,
    routable,
)
from fleetserve.policies.rollout import scale_down_order

T0 = 1_000_000.0
OK = Observation(InstanceObservation(alive=True), ProbeResult(True, "200"))
FAIL = Observation(InstanceObservation(alive=True), ProbeResult(False, "-> HTTP 503"))
ALIVE = Observation(InstanceObservation(alive=True), None)


def rep(rid: int, status: R, version: int = 1, **kw: object) -> ReplicaRecord:
    base = ReplicaRecord(
        service="s",
        replica_id=rid,
        version=version,
        status=status,
        created_at=T0,
        launched_at=T0,
        endpoint=f"http://127.0.0.1:{9000 + rid}",
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def settings(**kw: object) -> FleetSettings:
    base = FleetSettings(target_replicas=2, version=1, initial_delay_seconds=60)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_empty_fleet_creates_the_target() -> None:
    plan = plan_fleet([], {}, settings(target_replicas=3), T0)
    assert plan.actions == [CreateReplicas(3)]


def test_pending_replicas_start_within_the_launch_limit() -> None:
    replicas = [rep(i, R.PENDING) for i in range(1, 6)] + [rep(6, R.PROVISIONING)]
    plan = plan_fleet(replicas, {}, settings(target_replicas=6, max_concurrent_launches=3), T0)
    assert [a for a in plan.actions if isinstance(a, StartLaunch)] == [
        StartLaunch(1),
        StartLaunch(2),
    ]


def test_starting_replica_becomes_ready_on_a_passing_probe() -> None:
    plan = plan_fleet([rep(1, R.STARTING)], {1: OK}, settings(target_replicas=1), T0 + 5)
    assert plan.actions == [
        SetStatus(1, R.READY, None, {"first_ready_at": T0 + 5}, "readiness probe passed: 200")
    ]


def test_initial_delay_counts_from_launch() -> None:
    clock = FakeClock(T0)
    s = settings(target_replicas=1, initial_delay_seconds=60)
    clock.advance(59)
    assert plan_fleet([rep(1, R.STARTING)], {1: FAIL}, s, clock.now()).actions == []
    clock.advance(1)
    plan = plan_fleet([rep(1, R.STARTING)], {1: FAIL}, s, clock.now())
    term = plan.actions[0]
    assert isinstance(term, Terminate)
    assert term.final_status is R.FAILED_INITIAL_DELAY and term.cause is TerminationCause.FAILURE
    assert "initial_delay_seconds=60" in term.reason and "HTTP 503" in term.reason
    assert plan.actions[1:] == [CreateReplicas(1)]  # replaced in the same round


def test_ready_replica_failing_a_probe_is_not_ready_then_failed_after_the_window() -> None:
    s = settings(target_replicas=1, failure_window_seconds=180)
    plan = plan_fleet([rep(1, R.READY)], {1: FAIL}, s, T0 + 100)
    assert plan.actions == [
        SetStatus(
            1, R.NOT_READY, "readiness probe failed: -> HTTP 503", {"probe_failing_since": T0 + 100}
        )
    ]
    not_ready = rep(1, R.NOT_READY, probe_failing_since=T0 + 100)
    assert plan_fleet([not_ready], {1: FAIL}, s, T0 + 279).actions == []
    plan = plan_fleet([not_ready], {1: FAIL}, s, T0 + 280)
    assert isinstance(plan.actions[0], Terminate)
    assert plan.actions[0].final_status is R.FAILED_PROBING
    assert plan.actions[0].cause is TerminationCause.FAILURE  # its row stays, FAILED_PROBING


def test_not_ready_recovers_on_a_passing_probe() -> None:
    not_ready = rep(1, R.NOT_READY, probe_failing_since=T0)
    plan = plan_fleet([not_ready], {1: OK}, settings(target_replicas=1), T0 + 10)
    assert plan.actions == [
        SetStatus(
            1, R.READY, None, {"probe_failing_since": None}, "readiness probe passes again: 200"
        )
    ]


def test_exited_replica_is_failed_with_its_code_and_replaced() -> None:
    gone = Observation(InstanceObservation(alive=False, exit_code=3, detail="exited with code 3"))
    plan = plan_fleet([rep(1, R.READY), rep(2, R.READY)], {1: gone, 2: OK}, settings(), T0)
    assert plan.actions == [
        Terminate(
            1, R.FAILED, "replica process exited with code 3", TerminationCause.FAILURE, exit_code=3
        ),
        CreateReplicas(1),
    ]


def test_lost_instance_is_preempted() -> None:
    lost = Observation(InstanceObservation(alive=False, lost=True, detail="node gone"))
    plan = plan_fleet([rep(1, R.STARTING)], {1: lost}, settings(target_replicas=1), T0)
    assert isinstance(plan.actions[0], Terminate)
    assert plan.actions[0].final_status is R.PREEMPTED
    assert plan.actions[0].cause is TerminationCause.PREEMPTION
    assert not deletes_row(plan.actions[0].cause)  # its row stays, PREEMPTED


def test_no_probe_result_changes_nothing() -> None:
    assert (
        plan_fleet(
            [rep(1, R.READY), rep(2, R.STARTING)], {1: ALIVE, 2: ALIVE}, settings(), T0
        ).actions
        == []
    )


def test_too_many_replicas_scale_down_in_skyserve_order() -> None:
    replicas = [rep(1, R.READY), rep(2, R.READY), rep(3, R.READY), rep(4, R.STARTING)]
    plan = plan_fleet(replicas, {i: ALIVE for i in range(1, 5)}, settings(target_replicas=1), T0)
    downs = [a.replica_id for a in plan.actions if isinstance(a, Terminate)]
    assert downs == [4, 3, 2]  # not ready first, then the newest id
    ends = [a for a in plan.actions if isinstance(a, Terminate)]
    assert {a.cause for a in ends} == {TerminationCause.SCALE_DOWN}
    assert all(deletes_row(a.cause) for a in ends)


def test_scale_down_order_helper() -> None:
    order = scale_down_order([rep(1, R.READY), rep(2, R.PENDING), rep(3, R.NOT_READY)])
    assert [r.replica_id for r in order] == [2, 3, 1]


def test_crash_loop_stops_launches_and_says_why() -> None:
    failed = [rep(i, R.FAILED, reason=f"replica process exited with code {i}") for i in range(1, 4)]
    plan = plan_fleet(failed, {}, settings(target_replicas=1), T0)
    assert plan.failure_reason is not None  # launches stopped
    assert not any(isinstance(a, CreateReplicas) for a in plan.actions)
    assert plan.failure_reason is not None and "exited with code 3" in plan.failure_reason


def test_a_version_that_once_was_ready_keeps_being_replaced() -> None:
    failed = [rep(i, R.FAILED, first_ready_at=T0) for i in range(1, 4)]
    plan = plan_fleet(failed, {}, settings(target_replicas=1), T0)
    assert plan.failure_reason is None
    assert CreateReplicas(1) in plan.actions


def test_old_failed_rows_are_pruned_newest_kept() -> None:
    failed = [rep(i, R.PREEMPTED) for i in range(1, 8)]
    plan = plan_fleet(failed, {}, settings(target_replicas=0, keep_terminal_rows=5), T0)
    assert [a for a in plan.actions if isinstance(a, DeleteRow)] == [DeleteRow(2), DeleteRow(1)]


def test_shutdown_terminates_everything_not_already_stopping() -> None:
    replicas = [rep(1, R.READY), rep(2, R.SHUTTING_DOWN), rep(3, R.FAILED)]
    assert [t.replica_id for t in plan_shutdown(replicas)] == [1, 3]
    assert {t.cause for t in plan_shutdown(replicas)} == {TerminationCause.SERVICE_DOWN}
    assert all(deletes_row(t.cause) for t in plan_shutdown(replicas))


def test_routable_is_ready_replicas_of_active_versions() -> None:
    replicas = [
        rep(1, R.READY),
        rep(2, R.STARTING),
        rep(3, R.READY, version=2),
        rep(4, R.NOT_READY),
    ]
    assert [r.replica_id for r in routable(replicas, [1])] == [1]
    assert [r.replica_id for r in routable(replicas, [1, 2])] == [1, 3]


def test_replicas_of_an_older_version_are_retired_as_a_rollout() -> None:
    replicas = [rep(1, R.READY, version=1), rep(2, R.READY, version=2)]
    plan = plan_fleet(replicas, {1: OK, 2: OK}, settings(target_replicas=1, version=2), T0)
    ends = [a for a in plan.actions if isinstance(a, Terminate)]
    assert [(t.replica_id, t.reason, t.cause) for t in ends] == [
        (1, "replaced by version 2", TerminationCause.ROLLOUT)
    ]
    assert deletes_row(TerminationCause.ROLLOUT) and ends[0].drain


def test_only_replicas_torn_down_after_a_failure_count_towards_the_crash_loop() -> None:
    """A replica being scaled down before it was READY is no failure of its version."""

    def stopping(rid: int, cause: TerminationCause) -> ReplicaRecord:
        return rep(rid, R.SHUTTING_DOWN, reason="x", termination_cause=cause)

    failing = [stopping(i, TerminationCause.FAILURE) for i in (1, 2, 3)]
    assert plan_fleet(failing, {}, settings(target_replicas=1), T0).failure_reason is not None
    shrunk = [*failing[:2], stopping(3, TerminationCause.SCALE_DOWN)]
    assert plan_fleet(shrunk, {}, settings(target_replicas=1), T0).failure_reason is None


def test_a_failure_this_round_and_one_being_torn_down_count_towards_the_crash_loop() -> None:
    gone = Observation(InstanceObservation(alive=False, exit_code=4, detail="exited with code 4"))
    replicas = [
        rep(1, R.FAILED, reason="exited with code 4"),
        rep(2, R.SHUTTING_DOWN, reason="exited with code 4"),
        rep(3, R.STARTING),
    ]
    plan = plan_fleet(replicas, {3: gone}, settings(target_replicas=1), T0)
    assert plan.failure_reason is not None  # launches stopped
    assert not any(isinstance(a, CreateReplicas) for a in plan.actions)
    assert plan.failure_reason is not None
    assert "replica 3: replica process exited with code 4" in plan.failure_reason


def test_rows_are_created_only_as_launch_slots_free_up() -> None:
    """A target of a million writes at most the free launch slots' worth of rows per round."""
    huge = settings(target_replicas=1_000_000, max_concurrent_launches=4)
    assert plan_fleet([], {}, huge, T0).actions == [CreateReplicas(4)]
    two_launching = [rep(1, R.PROVISIONING), rep(2, R.PROVISIONING), rep(3, R.READY)]
    assert [a for a in plan_fleet(two_launching, {3: OK}, huge, T0).actions] == [CreateReplicas(2)]
    pending = [rep(i, R.PENDING) for i in range(1, 5)]
    plan = plan_fleet(pending, {}, huge, T0)
    assert not [a for a in plan.actions if isinstance(a, CreateReplicas)]
    assert [a for a in plan.actions if isinstance(a, StartLaunch)] == [
        StartLaunch(i) for i in range(1, 5)
    ]


def test_replacements_of_a_never_ready_version_stay_within_the_crash_loop_limit() -> None:
    # Target 2, limit 3: replicas 1 and 2 failed, nothing was ever READY: one replacement
    # only (3 launches in all), not two (a 4th launch past the limit).
    two_failed = [rep(1, R.FAILED), rep(2, R.FAILED)]
    plan = plan_fleet(two_failed, {}, settings(target_replicas=2), T0)
    assert [a for a in plan.actions if isinstance(a, CreateReplicas)] == [CreateReplicas(1)]
    assert plan.failure_reason is None
    # While that one is launching, no other is created.
    launching = [*two_failed, rep(3, R.PROVISIONING)]
    plan = plan_fleet(launching, {}, settings(target_replicas=2), T0)
    assert not any(isinstance(a, CreateReplicas) for a in plan.actions)
    # A first failure of a large fleet creates nothing while the others are still starting.
    big = [rep(1, R.FAILED), *(rep(i, R.STARTING) for i in range(2, 6))]
    plan = plan_fleet(big, {i: ALIVE for i in range(2, 6)}, settings(target_replicas=5), T0)
    assert not any(isinstance(a, CreateReplicas) for a in plan.actions)
    # A version that was READY once has no such bound: every failed replica is replaced.
    was_ready = [rep(1, R.FAILED, first_ready_at=T0), rep(2, R.FAILED), rep(3, R.READY)]
    plan = plan_fleet(was_ready, {3: OK}, settings(target_replicas=3), T0)
    assert CreateReplicas(2) in plan.actions


def test_the_crash_loop_reason_stays_the_same_as_more_replicas_fail() -> None:
    three = [rep(i, R.FAILED, reason=f"exited with code {i}") for i in range(1, 4)]
    four = [*three, rep(4, R.FAILED, reason="exited with code 4")]
    first = plan_fleet(three, {}, settings(target_replicas=4), T0).failure_reason
    later = plan_fleet(four, {}, settings(target_replicas=4), T0).failure_reason
    assert first is not None and later is not None
    assert first.split(" Last: ")[0] == later.split(" Last: ")[0]  # one event, not two
    assert later.endswith("replica 4: exited with code 4")


def test_shutdown_stops_again_a_row_whose_stop_ended_without_removing_it() -> None:
    """A row SHUTTING_DOWN with no stop under way (its task was cancelled, or its store write
    refused on a full disk) is stopped again; one with a stop under way is left to it (a
    `down` after a full disk waited forever on such a row before)."""
    rows = [ReplicaRecord("s", 1, 1, R.SHUTTING_DOWN)]
    assert plan_shutdown(rows, stopping=lambda _rid: True) == []
    assert [t.replica_id for t in plan_shutdown(rows, stopping=lambda _rid: False)] == [1]
