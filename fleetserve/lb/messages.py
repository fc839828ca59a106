"""What the controller and a load balancer say to each other, as one set of models for both
sides: the replica set the controller pushes (PUT /-/replicas, and the set in the LB's config
file) and the load report it reads (GET /-/load).

The field names are the wire format. A load balancer outlives the controller that started it,
so they do not change: a push stays what older load balancers take (they refuse unknown
fields), and a report's fields all have defaults (reports of older ones lack some).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.core.types import Endpoint, ReplicaId

# -- controller -> LB ---------------------------------------------------------------------------


class RoutableReplica(BaseModel):
    """A replica the load balancer may send requests to."""

    model_config = ConfigDict(extra="forbid")

    replica_id: int
    url: str = Field(pattern=r"^https?://")
    version: int = 1
    weight: float = Field(1.0, gt=0)  # instance_aware_least_load: the replica's target QPS

    @classmethod
    def of(cls, endpoint: Endpoint) -> RoutableReplica:
        return cls(
            replica_id=endpoint.replica_id,
            url=endpoint.url,
            version=endpoint.version,
            weight=endpoint.weight,
        )

    def endpoint(self) -> Endpoint:
        return Endpoint(ReplicaId(self.replica_id), self.url, self.version, self.weight)


class Canary(BaseModel):
    """A canary split: `percent` of the requests go to `version`, the rest to the others."""

    model_config = ConfigDict(extra="forbid")

    version: int
    percent: int = Field(ge=0, le=100)


class ReplicaPush(BaseModel):
    """The routable set (PUT /-/replicas): the whole set each time, not a change."""

    model_config = ConfigDict(extra="forbid")

    replicas: list[RoutableReplica]
    canary: Canary | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body: with no canary, no `canary` key."""
        return self.model_dump(mode="json", exclude_none=True)


# -- LB -> controller ---------------------------------------------------------------------------


class ReplicaLoad(BaseModel):
    """One replica's load now."""

    inflight: int = 0
    requests_per_second: float = 0.0  # over the report's window


class ReplicaTotals(BaseModel):
    """Counters since the load balancer started, for one replica ('none': answered by the LB
    itself): the controller turns two reports into rates and quantiles
    (fleetserve.controller.history)."""

    requests: int = 0
    errors: int = 0  # 5xx answers and failed upstream attempts
    latency: list[int] = Field(default_factory=list)  # cumulative per bound, +Inf last
    # Time to the first byte of the replica's answer (of a retried request: from the start of
    # the attempt that was answered); the same bounds. Empty from older load balancers.
    first_byte: list[int] = Field(default_factory=list)


class LoadReport(BaseModel):
    """GET /-/load: the sliding-window rates that the autoscaler uses and the counters that the
    dashboard's charts are made of; with several workers, all of theirs added up."""

    at: float = 0.0  # the load balancer's clock (time.time)
    window_seconds: int = 60
    latency_bounds: list[float] = Field(default_factory=list)  # of latency and first_byte
    requests_per_second: float = 0.0
    total_requests: int = 0  # since the load balancer started
    queued: int = 0  # held while no replica is ready
    replicas: dict[str, ReplicaLoad] = Field(default_factory=dict)  # by replica id
    totals: dict[str, ReplicaTotals] = Field(default_factory=dict)  # by replica id, or 'none'
