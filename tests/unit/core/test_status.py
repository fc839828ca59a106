"""Service status derivation from replica statuses."""

from __future__ import annotations

import pytest

from fleetserve.core.service_status import service_status
from fleetserve.core.status import ReplicaStatus as R
from fleetserve.core.status import ServiceStatus as S
from fleetserve.core.status import derive_service_status
from fleetserve.core.types import ReplicaRecord, ServicePhase, ServiceRecord
from fleetserve.spec.models import ServiceTask


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


def _svc(**faults: object) -> ServiceRecord:
    return ServiceRecord(
        name="web",
        phase=ServicePhase.ACTIVE,
        active_version=1,
        created_at=0.0,
        updated_at=0.0,
        lb_pid=faults.pop("lb_pid", 4242),
        **faults,
    )


def _rows(*statuses: R) -> list[ReplicaRecord]:
    return [
        ReplicaRecord(
            service="web",
            replica_id=i,
            version=1,
            status=s,
            infra="local",
            launch_token=f"t{i}",
            created_at=0.0,
            updated_at=0.0,
        )
        for i, s in enumerate(statuses, start=1)
    ]


@pytest.mark.parametrize(
    ("yaml_service", "faults", "rows", "expected"),
    [
        # a fixed fleet replaces a failed replica: not FAILED before its launches stop
        ({"replicas": 2}, {}, [R.FAILED_PROVISION], S.REPLICA_INIT),
        ({"replicas": 2}, {"launch_stop": "crash loop"}, [R.FAILED_PROVISION], S.FAILED),
        # a fleet that may be empty and has nothing coming: FAILED, as SkyServe says
        (
            {"replica_policy": {"min_replicas": 0, "max_replicas": 2, "target_qps_per_replica": 1}},
            {},
            [R.FAILED],
            S.FAILED,
        ),
        # the LB's fault, told apart by its own field, not by lb_pid
        (
            {"replicas": 1},
            {"lb_pid": None, "lb_error": "load balancer: port taken"},
            [],
            S.CONTROLLER_FAILED,
        ),
        ({"replicas": 1}, {"lb_pid": None}, [], S.CONTROLLER_INIT),
        # a pool has no load balancer and counts as running
        ({"pool": {"workers": 1}}, {"lb_pid": None}, [R.READY], S.READY),
        (
            {"pool": {"workers": 1}},
            {"lb_pid": None, "launch_stop": "crash loop"},
            [R.FAILED],
            S.FAILED,
        ),
    ],
)
def test_service_status_reads_the_typed_faults_and_the_spec(
    yaml_service: dict[str, object], faults: dict[str, object], rows: list[R], expected: S
) -> None:
    spec = ServiceTask.model_validate({"service": yaml_service, "run": "python3 -m http.server"})
    assert service_status(_svc(**faults), _rows(*rows), spec) is expected


def test_the_shown_failure_reason_is_the_most_pressing_fault() -> None:
    assert _svc().failure_reason is None
    assert _svc(launch_stop="loop").failure_reason == "loop"
    assert _svc(launch_stop="loop", lb_error="lb").failure_reason == "lb"
    assert _svc(launch_stop="loop", lb_error="lb", cleanup_error="stuck").failure_reason == "stuck"
