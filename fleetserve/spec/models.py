"""Pydantic models of the service YAML: the `service:` section and the task fields.

Every model forbids unknown keys (as SkyServe's JSON schema does), so a typo is an error that
names the field instead of a silently ignored setting. Field defaults are SkyServe's.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_INITIAL_DELAY_SECONDS = 1200
DEFAULT_PROBE_TIMEOUT_SECONDS = 15
DEFAULT_UPSCALE_DELAY_SECONDS = 300
DEFAULT_DOWNSCALE_DELAY_SECONDS = 1200
# SkyServe's three policies, then fleetserve's own (documented extensions).
LbPolicy = Literal[
    "round_robin",
    "least_load",
    "instance_aware_least_load",
    "power_of_two",
    "sticky",
    "prefix_affinity",
]
DEFAULT_LB_POLICY: LbPolicy = "least_load"

_ACCELERATOR_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:\d+(\.\d+)?)?$")
_CPUS = re.compile(r"^\d+(\.\d+)?\+?$")
_MEMORY = re.compile(r"^\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]?)?\+?$")
_PORT_RANGE = re.compile(r"^(\d+)(-(\d+))?$")

Port = Annotated[int, Field(ge=1, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReadinessProbe(_Strict):
    path: str
    initial_delay_seconds: Annotated[float, Field(ge=0)] = DEFAULT_INITIAL_DELAY_SECONDS
    timeout_seconds: Annotated[float, Field(gt=0)] = DEFAULT_PROBE_TIMEOUT_SECONDS
    post_data: dict[str, Any] | None = None
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _path_starts_with_slash(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must start with '/' (got {v!r})")
        return v

    @field_validator("post_data", mode="before")
    @classmethod
    def _post_data_json(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"a string post_data must be JSON: {e.msg}") from None
            if not isinstance(parsed, dict):
                raise ValueError("post_data must be a JSON object")
            return parsed
        return v

    @property
    def method(self) -> str:
        return "GET" if self.post_data is None else "POST"


class ReplicaPolicy(_Strict):
    min_replicas: Annotated[int, Field(ge=0)]
    max_replicas: Annotated[int, Field(ge=0)] | None = None
    target_qps_per_replica: Annotated[float, Field(gt=0)] | dict[str, float] | None = None
    # fleetserve's extensions: scale on requests in flight (as Ray Serve does) and the length
    # of the request-rate window.
    target_ongoing_requests_per_replica: Annotated[float, Field(gt=0)] | None = None
    qps_window_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0
    num_overprovision: Annotated[int, Field(ge=0)] | None = None
    upscale_delay_seconds: Annotated[float, Field(ge=0)] = DEFAULT_UPSCALE_DELAY_SECONDS
    downscale_delay_seconds: Annotated[float, Field(ge=0)] = DEFAULT_DOWNSCALE_DELAY_SECONDS
    base_ondemand_fallback_replicas: Annotated[int, Field(ge=0)] = 0
    dynamic_ondemand_fallback: bool = False
    spot_placer: Literal["dynamic_fallback"] | None = None

    @field_validator("target_qps_per_replica")
    @classmethod
    def _accelerator_targets(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if not v:
                raise ValueError("a per-accelerator target must name at least one accelerator")
            for key, qps in v.items():
                if not _ACCELERATOR_KEY.match(key):
                    raise ValueError(f"key {key!r} must look like 'ACCELERATOR' or 'ACC:COUNT'")
                if qps <= 0:
                    raise ValueError(f"target for {key!r} must be > 0 (got {qps})")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaPolicy:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        if self.autoscaled:
            if self.max_replicas is None:
                raise ValueError(
                    "max_replicas is required when target_qps_per_replica or "
                    "target_ongoing_requests_per_replica is set"
                )
        elif self.max_replicas is not None and self.max_replicas != self.min_replicas:
            raise ValueError(
                "without target_qps_per_replica (or target_ongoing_requests_per_replica) there "
                "is nothing to autoscale on: "
                f"max_replicas ({self.max_replicas}) must equal min_replicas "
                f"({self.min_replicas}) or be left out"
            )
        return self

    @property
    def autoscaled(self) -> bool:
        return (
            self.target_qps_per_replica is not None
            or self.target_ongoing_requests_per_replica is not None
        )

    @property
    def effective_max(self) -> int:
        return self.min_replicas if self.max_replicas is None else self.max_replicas


class Tls(_Strict):
    keyfile: str
    certfile: str


class LoadBalancerOptions(_Strict):
    """`service.load_balancer`: fleetserve's extension to the YAML (SkyServe has none)."""

    session_header: str | None = "X-Session-Id"  # sticky: the header that names a session
    session_cookie: str | None = None  # sticky: or a cookie
    prefix_chars: Annotated[int, Field(ge=1, le=100_000)] = 256  # prefix_affinity key length
    max_extra_load: Annotated[int, Field(ge=1)] = 4  # prefix_affinity: then least load wins
    connect_timeout_seconds: Annotated[float, Field(gt=0)] = 5.0
    read_timeout_seconds: Annotated[float, Field(gt=0)] = 600.0  # idle time between bytes
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    queue_size: Annotated[int, Field(ge=0)] = 256  # requests held while no replica is ready
    queue_timeout_seconds: Annotated[float, Field(ge=0)] = 300.0
    api_keys: list[Annotated[str, Field(min_length=16)]] = Field(default_factory=list, repr=False)
    workers: Annotated[int, Field(ge=1, le=64)] | None = None  # processes; default: cores, <= 4
    data_plane: Literal["python", "nginx"] = "python"  # nginx: the optional native data plane


class Pool(_Strict):
    workers: Annotated[int, Field(ge=0)] | None = None
    min_workers: Annotated[int, Field(ge=0)] | None = None
    max_workers: Annotated[int, Field(ge=0)] | None = None
    queue_length_threshold: Annotated[int, Field(ge=1)] | None = None
    upscale_delay_seconds: Annotated[float, Field(ge=0)] | None = None
    downscale_delay_seconds: Annotated[float, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> Pool:
        autoscaled = [
            self.min_workers,
            self.max_workers,
            self.queue_length_threshold,
            self.upscale_delay_seconds,
            self.downscale_delay_seconds,
        ]
        if self.workers is not None and any(v is not None for v in autoscaled):
            raise ValueError("use either 'workers' or the min_workers/max_workers form, not both")
        if self.workers is None and self.min_workers is None:
            raise ValueError("set 'workers', or 'min_workers' (with max_workers to autoscale)")
        if (
            self.min_workers is not None
            and self.max_workers is not None
            and self.max_workers < self.min_workers
        ):
            raise ValueError(
                f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})"
            )
        return self


class ServiceSection(_Strict):
    readiness_probe: ReadinessProbe | None = None
    replicas: Annotated[int, Field(ge=0)] | None = None
    replica_policy: ReplicaPolicy | None = None
    ports: Port | None = None
    load_balancing_policy: LbPolicy = DEFAULT_LB_POLICY
    tls: Tls | None = None
    pool: Pool | None = None
    load_balancer: LoadBalancerOptions = Field(default_factory=LoadBalancerOptions)
    # fleetserve's extension: replicas above the target while a rolling update overlaps
    # old and new versions (SkyServe's surge is unbounded).
    max_surge: Annotated[int, Field(ge=1)] = 1
    # ... and how many READY replicas the fleet may lack meanwhile (0: an old replica goes
    # only when a new one is READY in its place).
    max_unavailable: Annotated[int, Field(ge=0)] = 0

    @field_validator("readiness_probe", mode="before")
    @classmethod
    def _probe_shorthand(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _rules(self) -> ServiceSection:
        if self.replicas is not None and self.replica_policy is not None:
            raise ValueError("set either 'replicas' or 'replica_policy', not both")
        if self.pool is not None:
            for field in ("replica_policy", "ports"):
                if getattr(self, field) is not None:
                    raise ValueError(f"a pool cannot have '{field}'")
        elif self.readiness_probe is None:
            raise ValueError("'readiness_probe' is required (a path such as /health)")
        target = self.replica_policy.target_qps_per_replica if self.replica_policy else None
        instance_aware = self.load_balancing_policy == "instance_aware_least_load"
        if isinstance(target, dict) and not instance_aware:
            raise ValueError(
                "a per-accelerator target_qps_per_replica requires "
                "load_balancing_policy: instance_aware_least_load"
            )
        if instance_aware and not isinstance(target, dict):
            raise ValueError(
                "load_balancing_policy instance_aware_least_load requires target_qps_per_replica "
                "as a per-accelerator dict, e.g. {A100: 10, L4: 2}"
            )
        return self

    def replica_bounds(self) -> tuple[int, int]:
        """(min, max) replicas: `replicas: N` is N..N; neither field means 1..1 (SkyServe)."""
        if self.replica_policy is not None:
            return self.replica_policy.min_replicas, self.replica_policy.effective_max
        n = 1 if self.replicas is None else self.replicas
        return n, n


def _count_ports(ports: int | str | list[int | str] | None) -> int:
    if ports is None:
        return 0
    items = ports if isinstance(ports, list) else [ports]
    total = 0
    for item in items:
        if isinstance(item, int):
            total += 1
            continue
        m = _PORT_RANGE.match(item.strip())
        assert m is not None  # checked by the validator
        lo, hi = int(m.group(1)), int(m.group(3) or m.group(1))
        total += hi - lo + 1
    return total


class ResourcesBase(_Strict):
    """One set of resources. Cloud-only fields are accepted (files stay SkyServe-compatible)
    and ignored by the local infra."""

    infra: str | None = None
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    cpus: int | float | str | None = None
    memory: int | float | str | None = None
    accelerators: str | list[str] | dict[str, int | float | None] | None = None
    accelerator_args: dict[str, Any] | None = None
    instance_type: str | None = None
    use_spot: bool | None = None
    job_recovery: str | dict[str, Any] | None = None
    spot_recovery: str | None = None
    disk_size: int | str | None = None
    disk_tier: str | None = None
    network_tier: str | None = None
    ports: Port | str | list[Port | str] | None = None
    labels: dict[str, str] | None = None
    image_id: str | dict[str, str] | None = None
    autostop: bool | int | dict[str, Any] | None = None
    priority: int | None = None

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: Any) -> Any:
        if isinstance(v, str) and not _CPUS.match(v.strip()):
            raise ValueError(f"must be a number, optionally followed by '+' (got {v!r})")
        if isinstance(v, int | float) and v <= 0:
            raise ValueError(f"must be > 0 (got {v})")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: Any) -> Any:
        if isinstance(v, str) and not _MEMORY.match(v.strip()):
            raise ValueError(f"must be a size in GB such as 16 or '32+' (got {v!r})")
        if isinstance(v, int | float) and v <= 0:
            raise ValueError(f"must be > 0 (got {v})")
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: Any) -> Any:
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, str):
                m = _PORT_RANGE.match(item.strip())
                if not m:
                    raise ValueError(f"{item!r} is not a port or a range such as '8000-8010'")
                lo, hi = int(m.group(1)), int(m.group(3) or m.group(1))
                if not 1 <= lo <= hi <= 65535:
                    raise ValueError(f"{item!r} must lie within 1..65535, low to high")
        return v

    @property
    def port_count(self) -> int:
        return _count_ports(self.ports)

    def single_port(self) -> int | None:
        if self.port_count != 1 or self.ports is None:
            return None
        item = self.ports[0] if isinstance(self.ports, list) else self.ports
        return int(str(item).split("-")[0])


class Resources(ResourcesBase):
    any_of: list[ResourcesBase] | None = None
    ordered: list[ResourcesBase] | None = None

    @model_validator(mode="after")
    def _alternatives(self) -> Resources:
        if self.any_of is not None and self.ordered is not None:
            raise ValueError("set either 'any_of' or 'ordered', not both")
        return self

    def candidates(self) -> list[ResourcesBase]:
        """Each alternative with the shared fields filled in (the resources alone if none)."""
        alternatives = self.any_of or self.ordered
        base = self.model_dump(exclude={"any_of", "ordered"}, exclude_none=True)
        if not alternatives:
            return [ResourcesBase(**base)]
        return [ResourcesBase(**{**base, **a.model_dump(exclude_none=True)}) for a in alternatives]


EnvValue = str | int | float | bool | None


class ServiceTask(_Strict):
    """A whole service YAML: task fields plus the `service:` section."""

    name: str | None = None
    workdir: str | None = None
    num_nodes: Annotated[int, Field(ge=1)] = 1
    resources: Resources = Field(default_factory=Resources)
    envs: dict[str, EnvValue] = Field(default_factory=dict)
    secrets: dict[str, EnvValue] = Field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    file_mounts: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    service: ServiceSection
    config: dict[str, Any] | None = None
    event_callback: str | None = None
    inputs: dict[str, Any] | None = None
    outputs: dict[str, Any] | None = None
    volumes: dict[str, Any] | None = None

    @field_validator("envs", "secrets")
    @classmethod
    def _env_names(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for key in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return v

    @model_validator(mode="after")
    def _task_rules(self) -> ServiceTask:
        candidates = self.resources.candidates()
        spot = {bool(c.use_spot) for c in candidates}
        if len(spot) > 1:
            raise ValueError(
                "resources: every alternative must be spot (use_spot: true) or every one "
                "on-demand; mixing them is not supported"
            )
        uses_spot = spot == {True}
        policy = self.service.replica_policy
        if policy is not None and not uses_spot:
            if policy.base_ondemand_fallback_replicas > 0 or policy.dynamic_ondemand_fallback:
                raise ValueError(
                    "service.replica_policy: base_ondemand_fallback_replicas and "
                    "dynamic_ondemand_fallback need spot resources (resources.use_spot: true)"
                )
            if policy.spot_placer is not None:
                raise ValueError(
                    "service.replica_policy.spot_placer needs spot resources "
                    "(resources.use_spot: true)"
                )
        if self.service.pool is not None and self.run is not None:
            raise ValueError("a pool cannot have 'run' (jobs are submitted to it later)")
        if self.service.ports is None and any(c.port_count > 1 for c in candidates):
            raise ValueError(
                "resources.ports exposes more than one port: set service.ports to the one the "
                "load balancer should send traffic to"
            )
        return self

    @property
    def uses_spot(self) -> bool:
        return bool(self.resources.candidates()[0].use_spot)

    def accelerator(self) -> str | None:
        """The accelerator a replica of this spec has, when every candidate names the same one
        (what instance-aware policies weigh it by)."""
        names = set()
        for c in self.resources.candidates():
            acc = c.accelerators
            if isinstance(acc, dict | list):
                names |= set(acc)
            elif isinstance(acc, str):
                names.add(acc)
        return names.pop().split(":")[0] if len(names) == 1 else None

    def replica_port(self) -> int | None:
        """The port a replica must listen on, when the YAML fixes one; None means 'any'."""
        if self.service.ports is not None:
            return self.service.ports
        ports = {c.single_port() for c in self.resources.candidates()}
        ports.discard(None)
        return ports.pop() if len(ports) == 1 else None

    def requested_infra(self) -> str | None:
        infras = {c.infra for c in self.resources.candidates() if c.infra}
        return infras.pop() if len(infras) == 1 else None
