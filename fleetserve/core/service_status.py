"""A service's status, from its stored record, its replicas and its active spec: the one place
every reader (the API, the CLI's views, the controller's metrics, the pools' checks) takes it
from. Pure: no store, no clock."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from fleetserve.core.status import ServiceStatus, derive_service_status
from fleetserve.core.types import ReplicaRecord, ServicePhase, ServiceRecord


class _FleetSection(Protocol):
    """What the status reads of a spec's `service:` section (fleetserve.spec.models)."""

    @property
    def pool(self) -> object | None: ...

    def fleet_bounds(self) -> tuple[int, int]: ...


class FleetSpec(Protocol):
    @property
    def service(self) -> _FleetSection: ...


def service_status(
    service: ServiceRecord, replicas: Iterable[ReplicaRecord], spec: FleetSpec
) -> ServiceStatus:
    """A pool has no load balancer: it counts as running. A fleet whose floor is above zero
    replaces its failed replicas until launches stop (`launch_stop`), so it is REPLICA_INIT
    between a failure and its replacement, not FAILED."""
    pool = spec.service.pool is not None
    lb_running = service.lb_pid is not None or pool
    return derive_service_status(
        (r.status for r in replicas),
        shutting_down=service.phase is ServicePhase.SHUTTING_DOWN,
        lb_running=lb_running,
        lb_failed=not lb_running and service.lb_error is not None,
        scaling_stopped=service.launch_stop is not None,
        has_floor=spec.service.fleet_bounds()[0] > 0,
    )
