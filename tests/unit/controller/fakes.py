"""In-memory stand-ins for the infra and the load-balancer manager, and small helpers, so the
controller's parts run on a fake clock with no process, no sleep and no real replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fleetserve.core.errors import TerminalError
from fleetserve.core.types import Endpoint, ServiceRecord
from fleetserve.infra.base import InstanceKind, InstanceState, Launched, LaunchRequest, Location
from fleetserve.lb.config import LbConfig
from fleetserve.lb.messages import Canary, LoadReport
from fleetserve.spec.loader import parse_spec
from fleetserve.store import Store

REPLICA_PORT = 8000


def handle_of(service: str, replica_id: int) -> str:
    return f"{service}/{replica_id}"


def host_of(service: str, replica_id: int) -> str:
    """Each replica's host names its service and id, so a mock HTTP handler can answer per
    service (and a result that reaches the wrong service shows)."""
    return f"{service}-{replica_id}.test"


class FakeInfra:
    """The `Infra` protocol in memory. Launches succeed at once unless the test scripts
    errors (`errors`, raised one per launch, then `always`) or holds them (`gate`)."""

    name = "fake"

    def __init__(self, host: str | None = None) -> None:
        # Like the local infra's: the host its replicas' processes run on (None: not a
        # host's processes, like Ray's actors). fleetserve.infra.host.
        self.host = host
        self.errors: list[Exception] = []
        self.always: Exception | None = None
        self.terminate_error: Exception | None = None  # raised by every terminate
        self.terminate_gate: asyncio.Event | None = None  # every terminate waits for it
        self.gate: asyncio.Event | None = None
        self.launches: list[LaunchRequest] = []
        self.cancelled: list[LaunchRequest] = []
        self.terminated: list[tuple[str | None, str]] = []
        self.states: dict[str, InstanceState] = {}
        self.forgotten: list[str] = []
        self.log_lines: dict[str, list[str]] = {}  # handle_of(service, id) -> its log

    def set_state(
        self, service: str, replica_id: int, kind: InstanceKind, exit_code: int | None = None
    ) -> None:
        self.states[handle_of(service, replica_id)] = InstanceState(kind, exit_code, kind.value)

    def locations(self) -> list[Location]:
        return [Location(zone="test-a", region="test")]

    def prepare(self, service: str, resources: dict[str, Any]) -> None:
        return None

    async def launch(self, request: LaunchRequest) -> Launched:
        self.launches.append(request)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(request)
            raise
        if self.errors:
            raise self.errors.pop(0)
        if self.always is not None:
            raise self.always
        handle = handle_of(request.service, request.replica_id)
        self.states[handle] = InstanceState(InstanceKind.RUNNING)
        return Launched(handle, host_of(request.service, request.replica_id), REPLICA_PORT)

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        self.terminated.append((handle, launch_token))
        if self.terminate_gate is not None:
            await self.terminate_gate.wait()
        if self.terminate_error is not None:
            raise self.terminate_error
        if handle is not None:
            self.states[handle] = InstanceState(InstanceKind.EXITED, -15, "terminated")

    async def poll(self, handle: str) -> InstanceState:
        return self.states.get(handle, InstanceState(InstanceKind.LOST, None, "unknown handle"))

    async def sweep(self, known_tokens: set[str]) -> int:
        return 0

    def forget_service(self, service: str) -> None:
        self.forgotten.append(service)

    async def logs(
        self,
        service: str,
        replica_id: int,
        follow: bool,
        handle: str | None = None,
        tail: int | None = None,
    ) -> AsyncIterator[str]:
        lines = self.log_lines.get(handle_of(service, replica_id), [])
        for line in lines[-tail:] if tail else lines:
            yield line


@dataclass(frozen=True)
class Push:
    service: str
    endpoints: tuple[Endpoint, ...]
    at: float
    force: bool


class FakeLb:
    """The parts of `LbManager` a `ServiceReconciler` calls, with no process and no HTTP: an
    LB "runs" from `start` until `stop`, and a push is recorded."""

    def __init__(self, first_pid: int = 50_000, host: str | None = None) -> None:
        self.host = host  # the host its LBs run on (LbManager.host)
        self._next_pid = first_pid
        self.pids: dict[str, int] = {}  # service -> the pid of its running LB
        self.configs: dict[str, LbConfig] = {}
        self.started: list[LbConfig] = []
        self.pushes: list[Push] = []
        self.reports: dict[str, LoadReport] = {}
        self.stopped: list[tuple[str | None, int | None]] = []
        self.checked_ports: list[tuple[str, int]] = []
        self.loads: list[str] = []  # the services whose load report was read, in order
        self.retired: list[tuple[str, int | None, float]] = []  # (service, pid, drain)
        self.still_retiring: set[str] = set()  # services a test says have one finishing
        self.fail_starts = 0  # the next starts that fail (after writing their config)

    def is_running(self, svc: ServiceRecord) -> bool:
        return svc.lb_pid is not None and self.pids.get(svc.name) == svc.lb_pid

    def check_port(self, service: str, port: int) -> None:
        self.checked_ports.append((service, port))

    async def start(self, svc: ServiceRecord, config: LbConfig) -> tuple[int, float]:
        self.check_port(svc.name, config.port)
        if self.fail_starts > 0:
            self.fail_starts -= 1
            self.configs[svc.name] = config  # as LbManager.start writes the file first
            raise TerminalError("load balancer did not answer within 10 s of its start")
        self._next_pid += 1
        self.pids[svc.name] = self._next_pid
        self.configs[svc.name] = config
        self.started.append(config)
        return self._next_pid, 1_000.0 + self._next_pid

    async def push(
        self,
        svc: ServiceRecord,
        endpoints: list[Endpoint],
        now: float,
        force: bool = False,
        canary: Canary | None = None,
    ) -> bool:
        self.pushes.append(Push(svc.name, tuple(endpoints), now, force))
        return True

    async def load(self, svc: ServiceRecord) -> LoadReport | None:
        self.loads.append(svc.name)
        return self.reports.get(svc.name)

    def running_config(self, service: str) -> LbConfig | None:
        return self.configs.get(service)

    def retire(
        self, service: str, pid: int | None, create_time: float | None, drain_seconds: float
    ) -> None:
        self.retired.append((service, pid, drain_seconds))
        self.still_retiring.add(service)

    def restore_config(self, service: str, config: LbConfig) -> None:
        self.configs[service] = config

    def retiring(self, service: str) -> bool:
        return service in self.still_retiring

    async def stop_process(self, pid: int | None, create_time: float | None) -> None:
        self.stopped.append((None, pid))
        for name, running in list(self.pids.items()):
            if running == pid:
                del self.pids[name]

    async def stop(self, service: str, pid: int | None, create_time: float | None) -> None:
        self.stopped.append((service, pid))
        self.pids.pop(service, None)
        self.configs.pop(service, None)

    def last_push(self, service: str) -> Push:
        return [p for p in self.pushes if p.service == service][-1]


def service_yaml(replicas: int = 2, path: str = "/health", initial_delay: float = 1200) -> str:
    return (
        "service:\n"
        "  readiness_probe:\n"
        f"    path: {path}\n"
        f"    initial_delay_seconds: {initial_delay:g}\n"
        f"  replicas: {replicas}\n"
        "run: python3 server.py\n"
    )


def create_service(store: Store, name: str, yaml_text: str, now: float) -> ServiceRecord:
    return store.create_service(name, yaml_text, parse_spec(yaml_text).model_dump_json(), now)


async def settle(turns: int = 30) -> None:
    """Let background tasks (launches, probes over a mock transport, terminations) run to
    their end: a few turns of the event loop, no wall time."""
    for _ in range(turns):
        await asyncio.sleep(0)
