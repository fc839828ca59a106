"""Frozen records passed between layers (the store returns them; planners read them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, NewType, TypedDict

from fleetserve.core.status import ReplicaStatus

# A replica's id within its service (from 1, never reused). A type of its own, so that mypy
# tells it from the other ints that flow beside it (job ids, versions, ports, pids): a job id
# is not a replica id. Made only where ids enter: the store's rows, the API's paths.
ReplicaId = NewType("ReplicaId", int)
VersionId = int


class ReplicaKey(NamedTuple):
    """A replica's identity across the controller: ids start at 1 in every service, so state
    kept for replicas (probes, in-flight counts, drains) is keyed by both."""

    service: str
    replica_id: ReplicaId


class TerminationCause(enum.StrEnum):
    """Why the controller stops a replica: written on its row as it starts to (SHUTTING_DOWN),
    read by the executor (does the row go?), a restarted controller (what to finish), the
    crash-loop count and the metrics. Whether the row goes is derived from it: `deletes_row`."""

    SCALE_DOWN = "scale_down"  # the fleet shrank (or a spot fleet retired an on-demand spare)
    ROLLOUT = "rollout"  # replaced by a replica of a newer version
    USER = "user"  # `fleetserve down NAME --replica-id N` (POST .../replicas/N/terminate)
    SERVICE_DOWN = "service_down"  # `fleetserve down NAME`
    HOST_LOST = "host_lost"  # its processes ran on another host, whose controller is gone
    FAILURE = "failure"  # it failed: exited, failed its probe, never became READY, a broken worker
    PREEMPTION = "preemption"  # its instance was lost (a spot preemption)


# The causes whose replica leaves a row behind once stopped: how it ended, for `status` and
# the crash-loop count. Every other cause removes the row.
_KEEPS_ROW = frozenset({TerminationCause.FAILURE, TerminationCause.PREEMPTION})


def deletes_row(cause: TerminationCause | None) -> bool:
    """Whether a replica stopped for `cause` has its row deleted once stopped (None: it is not
    being stopped, so no). A failure or a preemption keeps its row, in its failed status; a
    replica the fleet no longer wants (scaled down, replaced, taken down by the user, another
    host's) goes: its processes, if that host's controller comes back, are then orphans there."""
    return cause is not None and cause not in _KEEPS_ROW


class ServicePhase(enum.StrEnum):
    """What the user asked of the service as a whole (status is derived, this is intent)."""

    ACTIVE = "ACTIVE"
    SHUTTING_DOWN = "SHUTTING_DOWN"


@dataclass(frozen=True)
class ReplicaRecord:
    service: str
    replica_id: ReplicaId
    version: VersionId
    status: ReplicaStatus
    reason: str | None = None
    infra: str = "local"
    launch_token: str = ""
    handle: str | None = None  # the infra's handle, serialised as JSON text by the infra
    endpoint: str | None = None
    port: int | None = None
    exit_code: int | None = None
    created_at: float = 0.0
    launched_at: float | None = None
    started_at: float | None = None
    first_ready_at: float | None = None
    probe_failing_since: float | None = None
    terminated_at: float | None = None
    updated_at: float = 0.0
    # Why it is being (or was) stopped; None until it is. Its row goes afterwards unless the
    # cause is a failure or a preemption (`deletes_row`).
    termination_cause: TerminationCause | None = None
    purge: bool = False  # delete the row once terminated, even if it failed
    zone: str | None = None  # where it runs (set at launch), when the infra has zones
    spot: bool = False  # a spot instance: may be preempted
    host: str | None = None  # the host its local processes run on (None: this one, or Ray)


@dataclass(frozen=True)
class ServiceRecord:
    name: str
    phase: ServicePhase
    active_version: VersionId
    created_at: float
    updated_at: float
    lb_port: int | None = None
    lb_admin_port: int | None = None
    lb_pid: int | None = None
    lb_create_time: float | None = None
    next_replica_id: ReplicaId = ReplicaId(1)
    launch_stop: str | None = None  # launches stopped: the version crash-loops
    lb_error: str | None = None  # the load balancer could not be started
    cleanup_error: str | None = None  # `down` could not terminate these replicas
    purge: bool = False
    stable_version: int | None = None
    previous_version: int | None = None
    update_mode: str | None = None
    traffic_percent: int | None = None
    lb_secret: str | None = None  # the LB admin API's bearer secret; never shown
    lb_host: str | None = None  # the host its LB process runs on (None: this one)

    @property
    def failure_reason(self) -> str | None:
        """The fault to show (the API's and the CLI's one `failure_reason`): the cleanup's,
        else the load balancer's, else the stop of launches."""
        return self.cleanup_error or self.lb_error or self.launch_stop

    @property
    def serving_version(self) -> int:
        return self.stable_version if self.stable_version is not None else self.active_version

    @property
    def rolling_out(self) -> bool:
        return self.serving_version != self.active_version


# -- change sets: what a writer may change in a row -------------------------------------------
# Each is the record's fields, less the row's key and `updated_at` (the store sets it), all
# optional: `Store.update_replica(rec, now, **changes)` takes them as keyword arguments
# (`Unpack`), so mypy checks every column's name and type at the call. The store still refuses
# an unknown name at run time (a caller that is not type-checked), and a test holds each one
# equal to its table's columns.


class ReplicaChanges(TypedDict, total=False):
    version: VersionId
    status: ReplicaStatus
    reason: str | None
    infra: str
    launch_token: str
    handle: str | None
    endpoint: str | None
    port: int | None
    exit_code: int | None
    created_at: float
    launched_at: float | None
    started_at: float | None
    first_ready_at: float | None
    probe_failing_since: float | None
    terminated_at: float | None
    termination_cause: TerminationCause | None
    purge: bool
    zone: str | None
    spot: bool
    host: str | None


class ServiceChanges(TypedDict, total=False):
    phase: ServicePhase
    active_version: VersionId
    created_at: float
    lb_port: int | None
    lb_admin_port: int | None
    lb_pid: int | None
    lb_create_time: float | None
    next_replica_id: ReplicaId
    launch_stop: str | None
    lb_error: str | None
    cleanup_error: str | None
    purge: bool
    stable_version: int | None
    previous_version: int | None
    update_mode: str | None
    traffic_percent: int | None
    lb_secret: str | None
    lb_host: str | None


@dataclass(frozen=True)
class VersionRecord:
    service: str
    version: VersionId
    yaml_text: str
    spec_json: str
    created_at: float


@dataclass(frozen=True)
class EventRecord:
    service: str
    at: float
    kind: str
    message: str
    replica_id: ReplicaId | None = None
    status_from: str | None = None
    status_to: str | None = None
    id: int = 0


@dataclass(frozen=True)
class Endpoint:
    """A routable replica: the one record of it, from the controller's reconciler to the load
    balancer's replica set (fleetserve.lb.replica_set.Upstream is this record). On the wire
    (a push, the LB's config file) it is fleetserve.lb.messages.RoutableReplica, converted
    there (`RoutableReplica.of`, `RoutableReplica.endpoint`)."""

    replica_id: ReplicaId
    url: str
    version: VersionId
    weight: float = 1.0  # instance_aware_least_load: the replica's target QPS


class JobStatus(enum.StrEnum):
    PENDING = "PENDING"  # queued: waiting for a free worker
    RUNNING = "RUNNING"  # started on a worker
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # exited non-zero, or lost its worker too often
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(frozen=True)
class JobRecord:
    job_id: int
    pool: str
    batch: int
    rank: int
    num_jobs: int
    status: JobStatus
    run: str
    envs_json: str = "{}"
    slots: float = 1.0
    name: str | None = None
    worker_id: ReplicaId | None = None  # the pool's replica it runs on (job ids are not these)
    launch_token: str = ""
    handle: str | None = None
    attempts: int = 0
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    updated_at: float = 0.0


class JobChanges(TypedDict, total=False):
    name: str | None
    batch: int
    rank: int
    num_jobs: int
    status: JobStatus
    run: str
    envs_json: str
    slots: float
    worker_id: ReplicaId | None
    launch_token: str
    handle: str | None
    attempts: int
    exit_code: int | None
    reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
