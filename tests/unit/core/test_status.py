"""Service status derivation from replica statuses."""

from __future__ import annotations

import pytest

from fleetserve.core.status import ReplicaStatus as R
from fleetserve.core.status import ServiceStatus as S
from fleetserve.core.status import derive_service_status


@pytest.mark.parametrize(
    ("replicas", "kwargs", "expected"),
    [
        ([], {}, S.NO_REPLICA),
        ([R.PENDING], {}, S.REPLICA_INIT),
        ([R.PROVISIONING, R.STARTING], {}, S.REPLICA_INIT),
        ([R.STARTING, R.READY], {}, S.READY),
        ([R.FAILED, R.READY], {}, S.READY),
        ([R.NOT_READY], {}, S.REPLICA_INIT),
        ([R.FAILED, R.PENDING], {}, S.REPLICA_INIT),
        ([R.FAILED, R.FAILED_PROBING], {}, S.FAILED),
        # A fleet with a floor replaces its failed replicas until the crash-loop stop.
        ([R.FAILED_PROVISION], {"has_floor": True}, S.REPLICA_INIT),
        ([R.FAILED_PROVISION], {"has_floor": True, "scaling_stopped": True}, S.FAILED),
        ([R.PREEMPTED], {}, S.NO_REPLICA),
        ([R.FAILED, R.PENDING], {"scaling_stopped": True}, S.FAILED),
        ([R.READY], {"scaling_stopped": True}, S.READY),
        ([R.READY], {"shutting_down": True}, S.SHUTTING_DOWN),
        ([R.FAILED_CLEANUP], {"shutting_down": True}, S.FAILED_CLEANUP),
        ([R.READY], {"lb_running": False}, S.CONTROLLER_INIT),
        ([R.READY], {"lb_running": False, "lb_failed": True}, S.CONTROLLER_FAILED),
        ([R.SHUTTING_DOWN], {}, S.NO_REPLICA),
    ],
)
def test_derive_service_status(replicas: list[R], kwargs: dict[str, bool], expected: S) -> None:
    assert derive_service_status(replicas, **kwargs) is expected


def test_failed_group_and_terminal_group() -> None:
    assert {s for s in R if s.is_failed} == {
        R.FAILED,
        R.FAILED_INITIAL_DELAY,
        R.FAILED_PROBING,
        R.FAILED_PROVISION,
        R.FAILED_CLEANUP,
        R.UNKNOWN,
    }
    assert R.PREEMPTED.is_terminal and not R.PREEMPTED.is_failed
    assert not R.SHUTTING_DOWN.is_terminal
