"""Starts, adopts, feeds and stops a service's load-balancer process.

The load balancer runs in its own session, so it outlives the controller: while the controller
is down or restarting it keeps serving its last replica set (DESIGN invariant 1). A restarted
controller adopts it (pid and process start time) instead of starting another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from fleetserve.controller.settings import Settings
from fleetserve.core.errors import TerminalError
from fleetserve.core.types import Endpoint, ServiceRecord
from fleetserve.infra.host import elsewhere, host_id
from fleetserve.lb.config import PARENT_ENV, LbConfig
from fleetserve.lb.messages import Canary, LoadReport, ReplicaPush, RoutableReplica
from fleetserve.lb.nginx_stale import stop_stale_nginx
from fleetserve.oshelpers.files import open_private
from fleetserve.oshelpers.ports import listeners_on, port_free
from fleetserve.oshelpers.procs import (
    HOME_ID_ENV,
    find_process,
    of_home,
    owned_by,
    process_alive,
    processes_where,
    started,
    stop_processes,
)

log = logging.getLogger("fleetserve.controller")
LB_SERVICE_ENV = "FLEETSERVE_LB_SERVICE"


def upstream_payload(endpoints: list[Endpoint]) -> list[RoutableReplica]:
    """The routable set as the load balancer's admin API (and its config file) take it."""
    return [RoutableReplica.of(e) for e in endpoints]


def _ids(pushed: object) -> list[int]:
    if not isinstance(pushed, tuple) or not pushed:
        return []
    return [int(e[0]) for e in pushed[0]]


def _change(before: object, after: object, most: int = 20) -> str:
    """The routable set as a log line: the ids when few, else how many and what changed (a
    thousand ids on every change made the controller's log its own cost)."""
    now = _ids(after)
    if len(now) <= most:
        return str(now)
    old = set(_ids(before))
    added = sorted(set(now) - old)
    removed = sorted(old - set(now))

    def some(ids: list[int]) -> str:
        return str(ids[:most])[:-1] + (f", ... {len(ids) - most} more]" if len(ids) > most else "]")

    return f"{len(now)} (added {some(added)}, removed {some(removed)})"


@dataclass
class LbState:
    pushed: object = None  # what was pushed last (replicas and canary split)
    pushed_at: float = 0.0
    children: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    # Load balancers replaced by a newer one, finishing their requests: pid -> create time.
    retiring: dict[int, float | None] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


# A retired load balancer that has not exited this long past its drain is killed.
RETIRE_MARGIN_SECONDS = 5.0


def _kill_group(pid: int) -> None:
    """SIGKILL a load balancer and its workers: its process group (it leads its own session,
    started by `LbManager.start`)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not a group's leader (not started by `start`): the process
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pass


def _auth(svc: ServiceRecord) -> dict[str, str]:
    return {"Authorization": f"Bearer {svc.lb_secret}"} if svc.lb_secret else {}


class LbManager:
    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        home_id: str = "",
        legacy_home: str | None = None,
        host: str | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.home_id = home_id
        # This host (fleetserve.infra.host): an LB recorded on another host is never probed,
        # adopted or stopped here (its pid means nothing on this one).
        self.host = host or host_id()
        self.legacy_home = legacy_home  # LBs started before home ids carry only the path
        self._state: dict[str, LbState] = {}
        self._ours_checked: set[tuple[int, float]] = set()  # LB processes known to be ours

    def log_path(self, service: str) -> str:
        return str(self.settings.logs_dir / service / "load-balancer.log")

    def is_running(self, svc: ServiceRecord) -> bool:
        """Whether the service's LB process runs (and is this home's). Every round of every
        service asks: a process's home is read once per process (its environment), after
        that only whether it still runs."""
        self.reap(svc.name)  # an LB this controller started and that died is a zombie until reaped
        if svc.lb_pid is None or svc.lb_create_time is None:
            return False
        if elsewhere(svc.lb_host, self.host):
            return False  # another host's process: not ours to probe (or to adopt)
        key = (svc.lb_pid, svc.lb_create_time)
        if key in self._ours_checked:
            if find_process(*key) is not None:
                return True
            self._ours_checked.discard(key)
            return False
        alive = process_alive(*key, self.home_id or None, self.legacy_home)
        if alive:
            self._ours_checked.add(key)
        return alive

    def _ours(self, pid: int | None, service: str) -> bool:
        """Whether `pid` is a load-balancer process (primary or worker) of this home's
        `service`: the only programs an LB may share its port with."""
        if pid is None:
            return False  # another user's process: its details are hidden from us
        try:
            p = psutil.Process(pid)
            env = p.environ()
        except (psutil.Error, OSError):
            return False
        return env.get(LB_SERVICE_ENV) == service and (
            not self.home_id or owned_by(p, self.home_id, self.legacy_home)
        )

    def check_port(self, service: str, port: int) -> None:
        """The reserved port must be free, or held only by this service's own lingering LB
        workers (SO_REUSEPORT, same user): never by another program or service."""
        if port_free(port):
            return
        holders = listeners_on(port)
        if holders and all(self._ours(pid, service) for pid in holders):
            return
        raise TerminalError(f"load balancer port {port} is in use by another program")

    def config_path(self, service: str) -> Path:
        return self.settings.home / "lb" / f"{service}.json"

    async def start(self, svc: ServiceRecord, config: LbConfig) -> tuple[int, float]:
        """Start the LB process with `config`; returns (pid, create_time) once it answers."""
        self.check_port(svc.name, config.port)
        config.write(self.config_path(svc.name))
        env = dict(os.environ)
        env[LB_SERVICE_ENV] = svc.name
        env["FLEETSERVE_HOME"] = str(self.settings.home)
        env[HOME_ID_ENV] = self.home_id
        out = open_private(Path(self.log_path(svc.name)))
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fleetserve.lb.nginx"
                    if config.options.data_plane == "nginx"
                    else "fleetserve.lb",
                    "--config",
                    str(self.config_path(svc.name)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            os.close(out)
        self._state.setdefault(svc.name, LbState()).children[proc.pid] = proc
        create_time = started(psutil.Process(proc.pid))
        for _ in range(100):
            if proc.poll() is not None:
                raise TerminalError(
                    f"load balancer exited with code {proc.returncode} at start "
                    f"(see `fleetserve logs {svc.name} --load-balancer --no-follow`)"
                )
            with contextlib.suppress(httpx.HTTPError):
                r = await self.client.get(
                    f"http://127.0.0.1:{config.admin_port}/-/health", timeout=1
                )
                if r.status_code == 200:
                    self._state[svc.name].pushed = None  # a new process knows no replicas yet
                    return proc.pid, create_time
            await asyncio.sleep(0.1)
        # Only this process: a load balancer being retired finishes its requests still.
        await self.stop_process(proc.pid, create_time)
        raise TerminalError("load balancer did not answer within 10 s of its start")

    async def push(
        self,
        svc: ServiceRecord,
        endpoints: list[Endpoint],
        now: float,
        force: bool = False,
        canary: Canary | None = None,
    ) -> bool:
        """Send the routable set if it changed (or is due again); False if the LB is unreachable."""
        state = self._state.setdefault(svc.name, LbState())
        key = (tuple((e.replica_id, e.url, e.version, e.weight) for e in endpoints), canary)
        due = now - state.pushed_at >= self.settings.lb_repush_interval
        if not force and key == state.pushed and not due:
            return True
        push = ReplicaPush(replicas=upstream_payload(endpoints), canary=canary)
        try:
            r = await self.client.put(
                f"http://127.0.0.1:{svc.lb_admin_port}/-/replicas",
                json=push.body(),
                timeout=2,
                headers=_auth(svc),
            )
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("could not push replicas to the load balancer of %s: %s", svc.name, e)
            state.pushed = None
            return False
        if key != state.pushed:
            log.info("service %s: routable replicas %s", svc.name, _change(state.pushed, key))
        state.pushed, state.pushed_at = key, now
        return True

    async def load(self, svc: ServiceRecord) -> LoadReport | None:
        """The LB's load report (request rates, in-flight per replica), or None."""
        try:
            r = await self.client.get(
                f"http://127.0.0.1:{svc.lb_admin_port}/-/load", timeout=2, headers=_auth(svc)
            )
            r.raise_for_status()
            return LoadReport.model_validate_json(r.content)
        except (httpx.HTTPError, ValueError):  # ValueError: pydantic's ValidationError too
            return None

    def restore_config(self, service: str, config: LbConfig) -> None:
        """Write back the config of the load balancer that runs (a failed start of its
        replacement overwrote the file)."""
        config.write(self.config_path(service))

    def running_config(self, service: str) -> LbConfig | None:
        """The config the running LB was started with (its file), if readable."""
        try:
            return LbConfig.read(self.config_path(service))
        except (OSError, ValueError):
            return None

    async def stop_process(self, pid: int | None, create_time: float | None) -> None:
        """SIGTERM one LB process (it drains its requests for up to 5 s, its workers at the
        same time), SIGKILL (its process group) after 8 s."""
        if pid is not None and process_alive(pid, create_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            for _ in range(80):
                if not process_alive(pid, create_time):
                    break
                await asyncio.sleep(0.1)
            else:
                if process_alive(pid, create_time):
                    _kill_group(pid)  # with its workers (one could be wedged past its drain)

    def retire(
        self, service: str, pid: int | None, create_time: float | None, drain_seconds: float
    ) -> None:
        """A newer load balancer took over: SIGQUIT the old one, which stops accepting and lets
        its requests finish for up to `drain_seconds` (a long stream is not cut), in the
        background; its process group is killed if it outlives that (and a margin)."""
        if pid is None or not process_alive(pid, create_time):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
        state = self._state.setdefault(service, LbState())
        state.retiring[pid] = create_time
        task = asyncio.get_running_loop().create_task(
            self._retired(state, pid, create_time, drain_seconds + RETIRE_MARGIN_SECONDS)
        )
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

    async def _retired(
        self, state: LbState, pid: int, create_time: float | None, within: float
    ) -> None:
        try:
            deadline = time.monotonic() + within
            while process_alive(pid, create_time) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            if process_alive(pid, create_time):
                log.warning("load balancer %s outlived its drain: killed", pid)
                _kill_group(pid)
        finally:
            state.retiring.pop(pid, None)

    def retiring(self, service: str) -> bool:
        """Whether a replaced load balancer of the service still finishes requests (a
        replica's drain waits for it: its requests are in no load report)."""
        state = self._state.get(service)
        return state is not None and any(
            process_alive(pid, ct) for pid, ct in state.retiring.items()
        )

    async def stop(self, service: str, pid: int | None, create_time: float | None) -> None:
        """Stop the service's LB for good (`down`): its process, a stray nginx, its config, and
        any replaced one still finishing requests (the replicas are going too)."""
        state = self._state.get(service)
        if state is not None:
            for old, ct in list(state.retiring.items()):
                if process_alive(old, ct):
                    _kill_group(old)
            for task in list(state.tasks):
                task.cancel()
        await self.stop_process(pid, create_time)
        stop_stale_nginx(self.config_path(service).with_suffix(".nginx"))  # if its driver died
        self.config_path(service).unlink(missing_ok=True)
        state = self._state.pop(service, None)
        if state is not None:
            for child in state.children.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=2)

    async def sweep(self, services: list[ServiceRecord]) -> int:
        """Stop load balancers of this home (by its id) that belong to no service (or an old
        process). A service whose LB is recorded on another host has none on this one: an LB
        of it here is stale (this host's controller lost a takeover while it ran)."""
        known: dict[str, tuple[int | None, float | None]] = {
            s.name: (s.lb_pid, s.lb_create_time) for s in services
        }
        for s in services:
            if elsewhere(s.lb_host, self.host):
                known[s.name] = (None, None)

        def orphan(env: dict[str, str]) -> bool:
            return (
                env.get(LB_SERVICE_ENV) is not None
                and bool(self.home_id)
                and of_home(env, self.home_id, self.legacy_home)
            )

        procs = []
        for p in await asyncio.to_thread(processes_where, orphan):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                env = p.environ()
                pid, create_time = known.get(env.get(LB_SERVICE_ENV, ""), (None, None))
                if not process_alive(pid, create_time):
                    procs.append(p)  # its service is gone, or has another LB now
                elif p.pid != pid and env.get(PARENT_ENV) != str(pid):
                    procs.append(p)  # neither that LB nor one of its workers
        if procs:
            await asyncio.to_thread(stop_processes, procs, 5.0)
        return len(procs)

    def reap(self, service: str | None = None) -> None:
        """Reap the LB processes this controller started that ended (one service's)."""
        if service is None:
            states = list(self._state.values())
        else:
            states = [self._state[service]] if service in self._state else []
        for state in states:
            for pid, child in list(state.children.items()):
                if child.poll() is not None:
                    del state.children[pid]
