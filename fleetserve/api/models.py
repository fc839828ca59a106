"""Payloads of the REST API. The SDK parses responses into these same models."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StringConstraints

MAX_OVERRIDES = 256  # --env / --secret values in one request, each kind
MAX_OVERRIDE_NAME = 256  # characters of a variable's name
MAX_OVERRIDE_VALUE = 64 * 1024  # characters of its value


def _no_nul(value: str) -> str:
    # A process environment, a path or a header cannot hold one: refused here, not at launch.
    if "\x00" in value:
        raise ValueError("a NUL character (\\0) is not allowed")
    return value


def _absolute(value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise ValueError("must be an absolute path (the caller's current folder)")
    return value


_Name = Annotated[str, StringConstraints(max_length=MAX_OVERRIDE_NAME), AfterValidator(_no_nul)]
_Value = Annotated[str, StringConstraints(max_length=MAX_OVERRIDE_VALUE), AfterValidator(_no_nul)]
_BaseDir = Annotated[
    str | None, AfterValidator(lambda v: _absolute(v if v is None else _no_nul(v)))
]
Overrides = Annotated[
    dict[_Name, _Value] | None,
    Field(
        max_length=MAX_OVERRIDES,
        description="Values over the YAML's (`--env` / `--secret`); each also fills a null "
        "entry, which otherwise refuses the request.",
    ),
]


class CreateService(BaseModel):
    model_config = ConfigDict(extra="forbid")
    yaml: str = Field(max_length=1024 * 1024, description="The service YAML, as text.")
    name: str | None = Field(
        None, min_length=1, max_length=64, description="Service name; default: the YAML's name."
    )
    base_dir: _BaseDir = Field(
        None,
        max_length=4096,
        description="Absolute folder that relative workdir, file_mounts and tls paths start "
        "from (the caller's current folder, as in SkyPilot); default: the controller's.",
    )
    infra: str | None = Field(
        None, max_length=64, description="local or ray; default: the YAML's, else local"
    )
    envs: Overrides = None
    secrets: Overrides = None
    host: str | None = Field(
        None,
        max_length=64,
        description="The address the endpoint binds (service.load_balancer.host overridden)",
    )


class UpdateService(BaseModel):
    model_config = ConfigDict(extra="forbid")
    yaml: str = Field(max_length=1024 * 1024, description="The new service YAML, as text.")
    base_dir: _BaseDir = Field(None, max_length=4096)
    mode: str = Field("rolling", max_length=16, description="rolling or blue_green")
    traffic_percent: int | None = Field(
        None, ge=1, le=99, description="A canary: this share of requests to the new version."
    )
    envs: Overrides = None
    secrets: Overrides = None


class ReplicaInfo(BaseModel):
    replica_id: int
    version: int
    status: str
    reason: str | None = None
    endpoint: str | None = None
    pid: int | None = None
    node: str | None = Field(None, description="The Ray node id, on the ray infra")
    exit_code: int | None = None
    created_at: float
    launched_at: float | None = None
    first_ready_at: float | None = None
    terminated_at: float | None = None
    zone: str | None = Field(None, description="Where it runs (the spot placer's choice)")
    spot: bool = Field(False, description="A spot instance (may be preempted)")


class EventInfo(BaseModel):
    event_id: int = Field(
        0,
        description="The event's id: increasing within a service; `after` on the events route "
        "takes it. 0 from a controller older than this field.",
    )
    at: float
    kind: str
    message: str
    replica_id: int | None = None
    status_from: str | None = None
    status_to: str | None = None


class ServiceInfo(BaseModel):
    name: str
    status: str
    endpoint: str | None = None
    active_version: int
    serving_version: int = 0
    update_mode: str | None = None
    traffic_percent: int | None = None
    created_at: float
    failure_reason: str | None = None
    load_balancing_policy: str
    min_replicas: int
    max_replicas: int
    target_replicas: int = Field(0, description="What the autoscaler wants now (or min).")
    replicas: list[ReplicaInfo] = Field(default_factory=list)
    spot_placer: dict[str, object] | None = Field(
        None, description="A spot service's placer and its zone marks (as stored)."
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="Fields of the YAML accepted with no effect here (cloud-only fields), "
        "one line each; set on the answer to create and update.",
    )


class ErrorBody(BaseModel):
    kind: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class Health(BaseModel):
    ok: bool
    version: str
    home_hash: str = Field(
        description="The controller's home folder keyed with the API token (HMAC): a client "
        "holding the token tells its own controller by it before sending the token "
        "(fleetserve.home.settings.home_hash)"
    )
    pid: int | None = Field(None, description="The controller's process id (with the token only)")
    home: str | None = Field(None, description="The controller's home folder (with the token only)")
    role: str = Field(
        "active",
        description='"active", or "standby" when another controller holds the lease '
        "(FLEETSERVE_HA; docs/scaling.md)",
    )
    processes: str | None = Field(
        None,
        description="How the local infra stops a replica's or job's processes: each in a "
        'cgroup of its own ("cgroup v2: ..."), or "token scan only (why): ..." where cgroups '
        "cannot be made (docs/security.md; with the token only)",
    )


ZoneName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9._-]*$")]


class ChaosPreempt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    service: str = Field(min_length=1, max_length=64)
    replica_id: int | None = Field(None, ge=1, le=2**31 - 1)
    zone: ZoneName | None = None


class ChaosCapacity(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity: dict[ZoneName, Annotated[int, Field(ge=0, le=10_000)] | None] = Field(
        max_length=64,
        description="Spot capacity per zone (null: unlimited). A zone below what it holds "
        "preempts its newest spot replicas.",
    )


class Preempted(BaseModel):
    service: str
    replica_id: int
    zone: str
    spot: bool


class ApplyPool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    yaml: str | None = Field(
        None, max_length=1024 * 1024, description="The pool YAML (omit to resize with workers)."
    )
    workers: StrictInt | None = Field(
        None, ge=0, le=1000, description="A fixed size (pool.workers)."
    )
    base_dir: _BaseDir = Field(None, max_length=4096)
    envs: Overrides = None
    secrets: Overrides = None


class LaunchJobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    yaml: str = Field(max_length=1024 * 1024, description="The job YAML (name, run, envs).")
    num_jobs: StrictInt = Field(1, ge=1, le=10_000, description="Ranks 0..num_jobs-1.")
    name: Annotated[str | None, AfterValidator(lambda v: v if v is None else _no_nul(v))] = Field(
        None, max_length=128
    )
    envs: Overrides = None


class CancelJobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_ids: list[Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]] | None = Field(
        None, max_length=10_000
    )
    pool: str | None = Field(None, min_length=1, max_length=64)


class JobInfo(BaseModel):
    job_id: int
    pool: str
    name: str | None = None
    batch: int
    rank: int
    num_jobs: int
    status: str
    worker_id: int | None = None
    attempts: int = 0
    exit_code: int | None = None
    reason: str | None = None
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None


class PoolApplied(BaseModel):
    pool: ServiceInfo
    action: str
    note: str | None = Field(
        None,
        description="What the user should know of the change (a resize that ended the "
        "pool's autoscaling); null when nothing.",
    )


class HistoryPoint(BaseModel):
    """One step of a chart (fleetserve.controller.history): traffic figures are null where no
    load report covered the step."""

    at: float
    rps: float | None = Field(None, description="requests per second")
    p50: float | None = Field(None, description="latency median, seconds")
    p99: float | None = Field(None, description="latency 99th percentile, seconds")
    inflight: int | None = None
    errors: float | None = Field(
        None, description="per second: 5xx answers and failed upstream attempts"
    )
    ready: int | None = Field(None, description="READY replicas (the service's series)")
    target: int | None = Field(None, description="the autoscaler's target (service's series)")
    version: int | None = Field(None, description="the replica's version (replica series)")


class ServiceHistory(BaseModel):
    service: str
    step_seconds: float
    horizon_seconds: float
    points: list[HistoryPoint] = Field(description="the service as a whole, oldest first")
    replicas: dict[str, list[HistoryPoint]] = Field(
        description="per replica id, oldest first; only replicas seen within the horizon"
    )
