"""Replica and service statuses (SkyServe's names) and the derivation of a service's status."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class ReplicaStatus(enum.StrEnum):
    PENDING = "PENDING"  # row written, waiting for a launch slot
    PROVISIONING = "PROVISIONING"  # launch in progress (process started, `setup` running)
    STARTING = "STARTING"  # `run` started, readiness probe not yet passed
    READY = "READY"  # probe passed: routable
    NOT_READY = "NOT_READY"  # was READY, probe failing now
    SHUTTING_DOWN = "SHUTTING_DOWN"  # being terminated
    FAILED = "FAILED"  # the user's process exited
    FAILED_INITIAL_DELAY = "FAILED_INITIAL_DELAY"  # never passed the probe within the delay
    FAILED_PROBING = "FAILED_PROBING"  # probe failed for the whole failure window
    FAILED_PROVISION = "FAILED_PROVISION"  # launch (setup included) failed
    FAILED_CLEANUP = "FAILED_CLEANUP"  # terminate failed: something may be left running
    PREEMPTED = "PREEMPTED"  # the instance was lost (node gone, process vanished)
    UNKNOWN = "UNKNOWN"

    @property
    def is_failed(self) -> bool:
        return self in FAILED_STATUSES

    @property
    def is_terminal(self) -> bool:
        """Nothing more happens to a replica in this status (besides removing its row)."""
        return self in TERMINAL_STATUSES

    @property
    def is_launching(self) -> bool:
        return self in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING)


FAILED_STATUSES = frozenset(
    {
        ReplicaStatus.FAILED,
        ReplicaStatus.FAILED_INITIAL_DELAY,
        ReplicaStatus.FAILED_PROBING,
        ReplicaStatus.FAILED_PROVISION,
        ReplicaStatus.FAILED_CLEANUP,
        ReplicaStatus.UNKNOWN,
    }
)
TERMINAL_STATUSES = FAILED_STATUSES | {ReplicaStatus.PREEMPTED}

# The order in which replicas are picked for scale-down (SkyServe's): least useful first.
SCALE_DOWN_ORDER = (
    ReplicaStatus.PENDING,
    ReplicaStatus.PROVISIONING,
    ReplicaStatus.STARTING,
    ReplicaStatus.NOT_READY,
    ReplicaStatus.READY,
)


class ServiceStatus(enum.StrEnum):
    CONTROLLER_INIT = "CONTROLLER_INIT"  # accepted, the load balancer is not up yet
    REPLICA_INIT = "REPLICA_INIT"  # replicas are launching, none ready
    READY = "READY"  # at least one replica is READY
    NO_REPLICA = "NO_REPLICA"  # the fleet is empty (scaled to zero)
    FAILED = "FAILED"  # every replica failed and none is coming up
    SHUTTING_DOWN = "SHUTTING_DOWN"
    FAILED_CLEANUP = "FAILED_CLEANUP"  # `down` could not terminate every replica
    CONTROLLER_FAILED = "CONTROLLER_FAILED"  # the load balancer could not be started


def derive_service_status(
    statuses: Iterable[ReplicaStatus],
    *,
    shutting_down: bool = False,
    lb_running: bool = True,
    lb_failed: bool = False,
    scaling_stopped: bool = False,
    has_floor: bool = False,
) -> ServiceStatus:
    """The service's status, from its replicas' statuses and a few service-level facts.

    `scaling_stopped` means the controller gave up launching (every replica of the version
    failed before it was ever ready): with no READY replica the service is then FAILED.
    `has_floor`: the service keeps at least one replica (min_replicas > 0), so a failed
    replica is replaced while scaling is not stopped: between its failure and its
    replacement's row the service is REPLICA_INIT, not a FAILED that `up` would stop on.
    """
    statuses = list(statuses)
    if shutting_down:
        if any(s is ReplicaStatus.FAILED_CLEANUP for s in statuses):
            return ServiceStatus.FAILED_CLEANUP
        return ServiceStatus.SHUTTING_DOWN
    if lb_failed:
        return ServiceStatus.CONTROLLER_FAILED
    if not lb_running:
        return ServiceStatus.CONTROLLER_INIT
    if any(s is ReplicaStatus.READY for s in statuses):
        return ServiceStatus.READY
    if scaling_stopped:
        return ServiceStatus.FAILED
    if any(not s.is_terminal and s is not ReplicaStatus.SHUTTING_DOWN for s in statuses):
        return ServiceStatus.REPLICA_INIT
    if any(s.is_failed for s in statuses):
        return ServiceStatus.REPLICA_INIT if has_floor else ServiceStatus.FAILED
    return ServiceStatus.NO_REPLICA
