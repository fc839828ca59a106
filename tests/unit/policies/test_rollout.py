"""Rollouts as tables: at rest, rolling within the surge, blue-green, canary, a failing
version."""

from __future__ import annotations

import dataclasses

from fleetserve.core.status import ReplicaStatus as R
from fleetserve.core.types import ReplicaRecord
from fleetserve.policies.rollout import BLUE_GREEN, RolloutSettings, plan_rollout


def rep(rid: int, version: int, status: R = R.READY) -> ReplicaRecord:
    return ReplicaRecord(service="s", replica_id=rid, version=version, status=status)


def ids(step_retire: tuple[ReplicaRecord, ...]) -> list[int]:
    return [r.replica_id for r in step_retire]


def test_at_rest_grows_and_shrinks_to_target() -> None:
    s = RolloutSettings(target=3, version=1)
    assert plan_rollout([rep(1, 1)], s, False).create == 2
    step = plan_rollout([rep(1, 1), rep(2, 1), rep(3, 1), rep(4, 1, R.STARTING)], s, False)
    assert ids(step.retire) == [4] and step.complete


def test_rolling_update_stays_within_the_surge() -> None:
    s = RolloutSettings(target=2, version=2, max_surge=1)
    old = [rep(1, 1), rep(2, 1)]
    step = plan_rollout(old, s, False)
    assert step.create == 1 and step.retire == ()  # 2 old + 1 new = target + surge
    step = plan_rollout([*old, rep(3, 2, R.STARTING)], s, False)
    assert step.create == 0 and step.retire == ()  # nothing retires before a new one is READY
    step = plan_rollout([*old, rep(3, 2)], s, False)
    assert ids(step.retire) == [2] and step.create == 0  # one READY new: one old goes
    step = plan_rollout([rep(1, 1), rep(3, 2)], s, False)
    assert step.create == 1 and step.retire == ()
    step = plan_rollout([rep(1, 1), rep(3, 2), rep(4, 2)], s, False)
    assert ids(step.retire) == [1] and step.complete


def test_rolling_never_exceeds_target_plus_surge() -> None:
    s = RolloutSettings(target=4, version=2, max_surge=1)
    for new_count in range(0, 5):
        alive = [rep(i, 1) for i in range(1, 5)] + [
            rep(10 + i, 2, R.STARTING) for i in range(new_count)
        ]
        step = plan_rollout(alive, s, False)
        assert len(alive) + step.create <= max(len(alive), 5)  # never launches past 4 + 1


def test_max_unavailable_lets_old_replicas_go_before_new_ones_are_ready() -> None:
    s = RolloutSettings(target=2, version=2, max_surge=1, max_unavailable=1)
    step = plan_rollout([rep(1, 1), rep(2, 1)], s, False)
    assert step.create == 1 and ids(step.retire) == [2]


def test_a_failing_new_version_leaves_the_old_one_serving() -> None:
    s = RolloutSettings(target=2, version=2)
    step = plan_rollout([rep(1, 1), rep(2, 1)], s, launches_stopped=True)
    assert step.create == 0 and step.retire == () and not step.complete


def test_blue_green_moves_traffic_in_one_step() -> None:
    s = RolloutSettings(target=2, version=2, mode=BLUE_GREEN, switch_ready=2)
    old = [rep(1, 1), rep(2, 1)]
    step = plan_rollout(old, s, False)
    assert step.create == 2 and not step.switch  # a whole second fleet
    step = plan_rollout([*old, rep(3, 2), rep(4, 2, R.STARTING)], s, False)
    assert not step.switch and step.retire == ()
    step = plan_rollout([*old, rep(3, 2), rep(4, 2)], s, False)
    assert step.switch and ids(step.retire) == [2, 1]


def test_canary_keeps_both_versions_at_their_shares() -> None:
    s = RolloutSettings(target=4, version=2, canary_percent=25)
    old = [rep(i, 1) for i in range(1, 5)]
    step = plan_rollout(old, s, False)
    assert step.create == 1 and step.retire == () and not step.complete
    step = plan_rollout([*old, rep(5, 2)], dataclasses.replace(s, canary_percent=None), False)
    assert ids(step.retire) == [4]  # promoted: a rolling update from there
