"""What the API answers: services, replicas and jobs as its models show them (pure reads of
the controller's store, shared by the routers in fleetserve/api/routes/)."""

from __future__ import annotations

import functools
import json
import socket
from dataclasses import dataclass
from typing import Any

from fleetserve.api.models import JobInfo, ReplicaInfo, ServiceInfo
from fleetserve.controller.controller import Controller
from fleetserve.controller.pools import STATE_KEY as POOL_KEY
from fleetserve.controller.pools import pool_bounds
from fleetserve.controller.scaling import STATE_KEY as AUTOSCALER_KEY
from fleetserve.core.types import JobRecord, ReplicaRecord, ServiceRecord
from fleetserve.spec.compat import compat_warnings
from fleetserve.spec.exposure import lb_host, reachable_host


def _handle_field(r: ReplicaRecord, key: str) -> object:
    return _handle_fields(r.handle).get(key) if r.handle else None


@functools.lru_cache(maxsize=4096)
def _handle_fields(handle: str) -> dict[str, object]:
    """A handle's JSON fields (read-only). A replica's handle never changes, and a listing
    of every service shows each replica's: parsed once, not twice per replica per call."""
    try:
        parsed = json.loads(handle)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _endpoint_host(ctl: Controller, svc: ServiceRecord) -> str:
    """Where clients reach the endpoint: the address the LB binds, this machine's name when it
    binds every address."""
    bound = lb_host(ctl.spec_of(svc), ctl.infra.name)
    return reachable_host(bound, socket.gethostname())


@dataclass(frozen=True)
class FleetRead:
    """What a listing of every service reads once for all of them (GET /services with a
    hundred services made three reads per service)."""

    replicas: dict[str, list[ReplicaRecord]]
    autoscaler: dict[str, dict[str, Any]]
    pools: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, ctl: Controller) -> FleetRead:
        return cls(
            ctl.store.replicas_by_service(),
            ctl.store.policy_states(AUTOSCALER_KEY),
            ctl.store.policy_states(POOL_KEY),
        )


def service_info(
    ctl: Controller, svc: ServiceRecord, fleet: FleetRead | None = None
) -> ServiceInfo:
    if fleet is None:
        replicas = ctl.store.list_replicas(svc.name)
    else:
        replicas = fleet.replicas.get(svc.name, [])
    spec = ctl.spec_of(svc)
    lo, hi = spec.service.replica_bounds()
    if spec.service.pool is not None:  # a pool's workers
        lo, hi = pool_bounds(spec.service.pool)
        target = ctl.pool_target_of(svc.name, lo, fleet.pools if fleet else None)
        # The stored target is the last round's: within the active version's bounds (`pool
        # apply --workers 1` answered "3 worker(s) wanted", the old size).
        target = min(max(target, lo), hi)
    else:
        target = ctl.target_of(svc.name, lo, fleet.autoscaler if fleet else None)
    return ServiceInfo(
        name=svc.name,
        status=ctl.status_of(svc, replicas).value,
        endpoint=(
            f"{'https' if spec.service.tls else 'http'}://{_endpoint_host(ctl, svc)}:{svc.lb_port}"
            if svc.lb_port and svc.lb_pid
            else None
        ),
        active_version=svc.active_version,
        serving_version=svc.serving_version,
        update_mode=svc.update_mode,
        traffic_percent=svc.traffic_percent,
        created_at=svc.created_at,
        failure_reason=svc.failure_reason,
        load_balancing_policy=spec.service.load_balancing_policy,
        min_replicas=lo,
        max_replicas=hi,
        target_replicas=target,
        replicas=[replica_info(r) for r in replicas],
        spot_placer=ctl.placer_of(svc.name) if spec.uses_spot else None,
    )


@functools.lru_cache(maxsize=8192)
def replica_info(r: ReplicaRecord) -> ReplicaInfo:
    """A replica as the API shows it (read-only: shared between answers). It changes only
    with its row, so each version of a row is made into one once, not at every listing."""
    return ReplicaInfo(
        replica_id=r.replica_id,
        version=r.version,
        status=r.status.value,
        reason=r.reason,
        endpoint=r.endpoint,
        pid=pid if isinstance(pid := _handle_field(r, "pid"), int) else None,
        node=node if isinstance(node := _handle_field(r, "node_id"), str) else None,
        exit_code=r.exit_code,
        created_at=r.created_at,
        launched_at=r.launched_at,
        first_ready_at=r.first_ready_at,
        terminated_at=r.terminated_at,
        zone=r.zone,
        spot=r.spot,
    )


def job_info(j: JobRecord) -> JobInfo:
    return JobInfo(
        job_id=j.job_id,
        pool=j.pool,
        name=j.name,
        batch=j.batch,
        rank=j.rank,
        num_jobs=j.num_jobs,
        status=j.status.value,
        worker_id=j.worker_id,
        attempts=j.attempts,
        exit_code=j.exit_code,
        reason=j.reason,
        created_at=j.created_at,
        started_at=j.started_at,
        ended_at=j.ended_at,
    )


def with_warnings(ctl: Controller, svc: ServiceRecord) -> ServiceInfo:
    """The service, with a line for each field of its YAML that has no effect here."""
    spec = ctl.spec_of(svc)
    lines = compat_warnings(spec, spec.requested_infra() or ctl.infra.name)
    return service_info(ctl, svc).model_copy(update={"warnings": lines})
