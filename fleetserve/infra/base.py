"""The `Infra` protocol (DESIGN.md): launch, terminate, poll and read the logs of replicas."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fleetserve.core.types import ReplicaId
from fleetserve.infra.git import GitSource


@dataclass(frozen=True)
class Location:
    zone: str
    region: str
    spot_capable: bool = False
    hourly_price: float = 0.0  # on demand, per instance
    spot_price: float = 0.0


@dataclass(frozen=True)
class FileMount:
    """A local file or folder copied into the replica's working directory at `dest`."""

    dest: str
    source: Path


@dataclass(frozen=True)
class LaunchRequest:
    service: str
    replica_id: ReplicaId
    version: int
    launch_token: str  # carried by every process of the replica: finds what a cut-short launch left
    run: str
    setup: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None  # copied into the replica's own working directory
    workdir_git: GitSource | None = None  # or cloned into it (`workdir: {url, ref}`)
    file_mounts: tuple[FileMount, ...] = ()
    port: int | None = None  # a port the spec fixes; None: the infra picks a free one
    # A fixed port shared by several replicas: each needs a network of its own (local: a
    # namespace per replica, as a container would have).
    own_network: bool = False
    spot: bool = False  # a spot instance (preemptible)
    zone: str | None = None  # where the placer put it; None: the infra chooses
    gpus: int = 0  # its accelerators (SKYPILOT_NUM_GPUS_PER_NODE; fleetserve.spec.task_env)


class InstanceKind(enum.StrEnum):
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    LOST = "LOST"  # gone with no exit status: preempted, node lost, killed from outside


@dataclass(frozen=True)
class InstanceState:
    kind: InstanceKind
    exit_code: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Launched:
    """What a successful launch returns: the handle (opaque JSON text) and where to reach it."""

    handle: str
    host: str
    port: int
    zone: str | None = None  # where it runs, when the infra has zones

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}"


class Infra(Protocol):
    name: str

    def locations(self) -> list[Location]: ...

    def prepare(self, service: str, resources: dict[str, Any]) -> None:
        """Learn the resources a service's replicas ask for (placement)."""
        ...

    async def launch(self, request: LaunchRequest) -> Launched:
        """Start the replica and run its setup; return once `run` has started.

        Raises `TerminalError` when setup fails. Cancelling the call cleans up what it started.
        """
        ...

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        """Stop every process of the replica (idempotent; works with no handle, by token)."""
        ...

    async def poll(self, handle: str) -> InstanceState: ...

    async def sweep(self, known_tokens: set[str]) -> int:
        """Stop replicas this home started whose token no row knows; returns how many."""
        ...

    def forget_service(self, service: str) -> None:
        """Remove what the infra kept for a service that is gone (working folders)."""
        ...

    def logs(
        self,
        service: str,
        replica_id: ReplicaId,
        follow: bool,
        handle: str | None = None,
        tail: int | None = None,
    ) -> AsyncIterator[str]:
        """The replica's log lines (only the last `tail` ones, if given); with `follow`, new
        lines as they come."""
        ...


class ReportsListeners(Protocol):
    """An infra that can say which TCP ports a replica's processes listen on (local: read
    from /proc). A probe that cannot connect names them: the server may listen, on another
    port. Optional."""

    def listening_ports(self, handle: str) -> list[int] | None: ...


# Told (service, replica_id) when an infra learns that a replica's instance ended.
ExitCallback = Callable[[str, ReplicaId], None]


class WatchesExits(Protocol):
    """An infra that learns at once when a replica's instance ends (its process exits, its
    node is lost) and says so: the controller wakes that service's reconciler, which polls,
    sees it and takes it out of the load balancer's set within a round, instead of at its
    next scheduled round (up to FLEETSERVE_RECONCILE_INTERVAL later). Optional: an infra
    without it is polled every round as before."""

    def watch_exits(self, callback: ExitCallback) -> None:
        """Call `callback(service, replica_id)` (on the controller's event loop) whenever a
        replica launched or adopted from now on ends."""
        ...
