"""What the controller hands a load-balancer process: one JSON file (mode 0600, as it may hold
API keys), read once at start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.lb.messages import RoutableReplica
from fleetserve.spec.models import LbPolicy, LoadBalancerOptions

# Set on every process an LB starts (its workers, its nginx): the LB's pid, by which the
# controller tells them from a stray process of the service (defined here, a module the
# controller imports anyway, rather than beside the workers and the proxy).
PARENT_ENV = "FLEETSERVE_LB_PARENT"


class LbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    service: str
    host: str = "127.0.0.1"
    port: int
    admin_port: int
    policy: LbPolicy = "least_load"
    options: LoadBalancerOptions = Field(default_factory=LoadBalancerOptions)
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    hold_when_empty: bool = False  # min_replicas 0: hold requests until a replica is READY
    wake_url: str | None = None  # POSTed (at most once a second) when a request is held
    # The bearer secret of the admin API; None only in tests. It never leaves the LB.
    admin_secret: str | None = None
    # The wake-up call's credential (fleetserve.lb.wake.wake_token of the admin secret).
    wake_token: str | None = None
    # Retired (SIGQUIT: a load balancer with new settings replaces it), it lets the requests
    # in progress finish for up to this long (the controller's drain_seconds); a stop
    # (SIGTERM) gives them 5 s.
    drain_seconds: Annotated[float, Field(ge=0, le=3600)] = 5.0
    # The routable set when the process starts (a restarted LB serves at once); pushes follow.
    replicas: list[RoutableReplica] = Field(default_factory=list)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.chmod(0o600)
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> LbConfig:
        return cls.model_validate_json(path.read_text())
