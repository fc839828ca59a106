"""The local infra: each replica is a process group on this machine.

A replica gets its own directory (a copy of the spec's workdir), a port in $PORT and a log file.
A small bash wrapper runs `setup`, marks it done, runs `run` and records its exit code, so a
controller that restarts and adopts the replica (not its child any more) still learns how it
ended. Every process of a replica carries FLEETSERVE_LAUNCH_TOKEN in its environment: terminate
finds them all by that token, including children that left the process group, and only them.
Where cgroups can be made (fleetserve.infra.cgroups), each replica also runs in a cgroup of its
own, which holds the processes that clear their environment too, and terminate kills it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fleetserve.core.errors import TerminalError
from fleetserve.core.types import ReplicaId
from fleetserve.infra.base import (
    ExitCallback,
    InstanceKind,
    InstanceState,
    Launched,
    LaunchRequest,
    Location,
)
from fleetserve.infra.cgroups import Cgroups, replica_name
from fleetserve.infra.host import host_id
from fleetserve.infra.jobs import JobRequest, LocalJobs, job_log
from fleetserve.infra.kv_ports import KV_EVENTS_PORTS
from fleetserve.infra.listening import listening_ports
from fleetserve.infra.missing import setup_missing
from fleetserve.infra.netns import REFUSAL, ReplicaNetworks
from fleetserve.infra.replica import (
    ReplicaLayout,
    create_replica_dir,
    replica_env,
    replica_layout,
)
from fleetserve.infra.zones import Held, NoCapacity, ZoneBook, ZoneConfig
from fleetserve.oshelpers.files import open_private, read_lines
from fleetserve.oshelpers.ports import fixed_port_taken, free_port, port_free
from fleetserve.oshelpers.procs import (
    HOME_ID_ENV,
    find_process,
    of_home,
    owned_by,
    processes_where,
    spawn_session,
    started,
    stop_processes,
)
from fleetserve.spec.task_env import NODE_IPS, SETUP_NODE_IPS, task_env

TOKEN_ENV = "FLEETSERVE_LAUNCH_TOKEN"

_ENTRY = """\
# Written by fleetserve: runs the replica's setup, then its run command.
cd {workdir}
if [ -s {dir}/setup.sh ]; then
  echo "[fleetserve] replica $FLEETSERVE_REPLICA_ID: running setup"
  bash {dir}/setup.sh
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "[fleetserve] setup failed with exit code $rc"
    echo $rc > {dir}/setup.failed
    exit $rc
  fi
fi
: > {dir}/{done}
echo "[fleetserve] replica $FLEETSERVE_REPLICA_ID: starting run on port $PORT"
bash {dir}/run.sh
rc=$?
echo $rc > {dir}/{exit_code}
echo "[fleetserve] run exited with code $rc"
exit $rc
"""


@dataclass(frozen=True)
class LocalHandle:
    pid: int
    create_time: float
    port: int
    dir: str
    netns: str | None = None  # the replica's own network namespace (a fixed-port fleet)
    address: str | None = None  # its address there
    # Where it runs (zones: fleetserve.infra.zones); absent in handles of older versions.
    service: str | None = None
    replica_id: ReplicaId | None = None
    zone: str | None = None
    spot: bool | None = None
    cgroup: str | None = None  # its cgroup (fleetserve.infra.cgroups), where there is one

    def to_json(self) -> str:
        d = {k: v for k, v in self.__dict__.items() if v is not None}
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LocalHandle:
        d = json.loads(text)
        return cls(
            pid=int(d["pid"]),
            create_time=float(d["create_time"]),
            port=int(d["port"]),
            dir=d["dir"],
            netns=d.get("netns"),
            address=d.get("address"),
            service=d.get("service"),
            replica_id=d.get("replica_id"),
            zone=d.get("zone"),
            spot=d.get("spot"),
            cgroup=d.get("cgroup"),
        )


def processes_with_token(token: str) -> list[psutil.Process]:
    """Every live process whose environment carries this launch token."""
    return processes_where(lambda env: env.get(TOKEN_ENV) == token)


class LocalInfra:
    name = "local"

    def __init__(
        self,
        home: Path,
        grace_seconds: float = 10.0,
        poll_interval: float = 0.1,
        home_id: str = "",
        umask: int | None = None,
        legacy_home: str | None = None,
        replica_net: str | None = None,
        replica_netns: str = "auto",
        zones: list[ZoneConfig] | None = None,
        host: str | None = None,
        cgroups: str = "auto",
    ) -> None:
        self.home = home
        # Each replica and job in a cgroup of its own where this user may make them; else the
        # token scan alone (fleetserve.infra.cgroups). Found on first use.
        self.cgroups = Cgroups(home_id, home, cgroups)
        # This host (fleetserve.infra.host): a replica's row records it at launch, and a
        # controller on another host never touches that replica's processes.
        self.host = host or host_id()
        self.zones = ZoneBook(zones or [ZoneConfig("local")])
        self._preempted: dict[int, str] = {}  # pid -> why (preempted replicas poll LOST)
        self.jobs = LocalJobs(home, home_id, TOKEN_ENV, umask, grace_seconds, self.cgroups)
        self.networks = ReplicaNetworks(home_id, replica_net, replica_netns)  # fixed-port fleets
        self.home_id = home_id
        self.legacy_home = legacy_home  # processes of a home from before home ids
        self.grace_seconds = grace_seconds
        self.poll_interval = poll_interval
        self.umask = umask  # the replicas' (the user's), not the controller's private 077
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._recent_ports: set[int] = set()
        self._owned: set[tuple[int, float]] = set()  # adopted processes checked to be ours
        self._on_exit: ExitCallback | None = None  # told at once when a replica's leader ends
        self._watched: dict[int, int] = {}  # pid -> its pidfd, on the event loop

    def _env_ours(self, env: dict[str, str]) -> bool:
        """A process environment of this home (`of_home`); any, for an infra with no home id."""
        return not self.home_id or of_home(env, self.home_id, self.legacy_home)

    def _ours(self, p: psutil.Process, create_time: float) -> bool:
        """An adopted process is ours only if it carries this home's id (a database copied
        into another home must not adopt, or stop, the first home's replicas)."""
        key = (p.pid, create_time)
        if key in self._owned:
            return True
        if not owned_by(p, self.home_id, self.legacy_home):
            return False
        self._owned.add(key)
        return True

    def locations(self) -> list[Location]:
        return [
            Location(
                zone=z.name,
                region="local",
                spot_capable=True,  # spot capacity may come and go (chaos)
                hourly_price=z.od_price,
                spot_price=z.spot_price,
            )
            for z in self.zones.zones
        ]

    def _hold(self, token: str, h: LocalHandle) -> None:
        if h.zone is not None and h.service is not None and h.replica_id is not None:
            self.zones.held[token] = Held(
                h.service, h.replica_id, h.zone, bool(h.spot), h.create_time, h.pid
            )

    def set_spot_capacity(self, zone: str, capacity: int | None) -> list[Held]:
        """A zone's spot capacity changes (`chaos`): the newest spot replicas beyond it are
        preempted (killed at once, no drain); returns them."""
        victims = self.zones.set_spot_capacity(zone, capacity)
        why = f"preempted: zone {zone}'s spot capacity fell to {capacity}"
        return [self._preempt(token, held, why) for token, held in victims]

    def preempt(
        self, service: str, replica_id: ReplicaId | None = None, zone: str | None = None
    ) -> list[Held]:
        """Preempt a service's replica, or every spot replica it has in a zone (`chaos`)."""
        if zone is not None:
            self.zones.config(zone)
        out = []
        for token, held in list(self.zones.held.items()):
            if held.service != service:
                continue
            if replica_id is not None and held.replica_id != replica_id:
                continue
            if zone is not None and (held.zone != zone or not held.spot):
                continue
            where = f"zone {held.zone}"
            out.append(self._preempt(token, held, f"preempted by fleetserve chaos ({where})"))
        return out

    def _preempt(self, token: str, held: Held, why: str) -> Held:
        self._preempted[held.pid] = why
        self.zones.held.pop(token, None)
        cgroup = self.cgroups.find(token)
        if cgroup is not None:
            self.cgroups.kill(cgroup)  # a lost host: no SIGTERM, no grace; removed at terminate
        procs = processes_with_token(token)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return held

    def prepare(self, service: str, resources: dict[str, Any]) -> None:
        """Nothing to place: every replica runs on this machine."""

    def layout(self, service: str, replica_id: ReplicaId) -> ReplicaLayout:
        return replica_layout(self.home / "replicas", service, replica_id)

    def log_path(self, service: str, replica_id: ReplicaId) -> Path:
        return self.home / "logs" / service / f"replica-{replica_id}.log"

    def _prepare(self, req: LaunchRequest) -> tuple[ReplicaLayout, Path]:
        """The replica's folder (fleetserve.infra.replica) and its wrapper; its log's path."""
        layout = self.layout(req.service, req.replica_id)
        create_replica_dir(
            layout,
            run=req.run,
            setup=req.setup,
            workdir=req.workdir,
            workdir_git=req.workdir_git,
            file_mounts=req.file_mounts,
        )
        (layout.dir / "entry.sh").write_text(
            _ENTRY.format(
                workdir=shlex.quote(str(layout.workdir)),
                dir=shlex.quote(str(layout.dir)),
                done=layout.setup_done.name,
                exit_code=layout.exit_code.name,
            )
        )
        return layout, self.log_path(req.service, req.replica_id)

    def replica_env(self, request: LaunchRequest, port: int, zone: str | None) -> dict[str, str]:
        """The replica's environment (fleetserve.infra.replica.replica_env, from this
        process's own), with the markers this infra finds its processes by."""
        env = replica_env(
            os.environ,
            envs=request.envs,
            port=port,
            service=request.service,
            replica_id=request.replica_id,
            version=request.version,
            task=task_env(
                "127.0.0.1",
                request.gpus,
                f"{request.service}-{request.replica_id}",
                "local",
                "local",
                zone,
            ),
        )
        env[TOKEN_ENV] = request.launch_token
        if self.home_id:
            env[HOME_ID_ENV] = self.home_id
        return env

    def _pick_port(self, req: LaunchRequest) -> int:
        if req.port is not None and req.own_network:
            return req.port  # free in the replica's own, new namespace
        if req.port is not None:
            taken = fixed_port_taken(req.port)
            if taken:
                raise TerminalError(taken)
            return req.port
        # The next two ports too: a replica may publish its KV cache events on them
        # (FLEETSERVE_KV_EVENTS_PORT, _REPLAY_PORT: cache_aware's precise mode).
        for _ in range(20):
            port = free_port(self._recent_ports)
            if port + KV_EVENTS_PORTS < 65536 and all(
                port_free(p) for p in range(port + 1, port + 1 + KV_EVENTS_PORTS)
            ):
                break
        self._recent_ports.update(range(port, port + 1 + KV_EVENTS_PORTS))
        if len(self._recent_ports) > 256:
            self._recent_ports.pop()
        return port

    async def launch(self, request: LaunchRequest) -> Launched:
        zone = self.zones.place(request.zone, request.spot)  # NoCapacity: a full zone
        layout, log = await asyncio.to_thread(self._prepare, request)
        rdir = layout.dir
        port = self._pick_port(request)
        netns: str | None = None
        address = "127.0.0.1"
        env = self.replica_env(request, port, zone)
        relay: socket.socket | None = None  # this machine's end of a user namespace's relay
        relay_port = 0
        how = await asyncio.to_thread(self.networks.kind) if request.own_network else None
        if request.own_network and how is None:
            raise TerminalError(REFUSAL)
        if how == "veth":
            netns, address = await asyncio.to_thread(
                self.networks.create, request.launch_token, env
            )
            env[NODE_IPS] = env[SETUP_NODE_IPS] = address  # the replica's own, in its namespace
        elif how == "userns":
            relay = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            relay.bind(("127.0.0.1", 0))
            relay.listen(1024)
            relay_port = int(relay.getsockname()[1])
        cgroup: Path | None = None
        out = -1
        try:
            # Made here, not in a thread: a cancelled launch never leaves one being made. (The
            # first call checks whether cgroups can be used: a few milliseconds, once.)
            cgroup = self.cgroups.create(
                replica_name(request.service, request.replica_id, request.launch_token)
            )
            out = open_private(log)
            entry = ["bash", str(rdir / "entry.sh")]
            if netns:
                entry = ["ip", "netns", "exec", netns, *entry]
            elif relay is not None:
                entry = [
                    *(sys.executable, "-m", "fleetserve.infra.userns"),
                    *("--listen-fd", str(relay.fileno()), "--port", str(port), "--", *entry),
                ]
            # The first process enters the cgroup before anything else runs: every process of
            # the replica (namespaces, relay, setup, run) is forked inside it.
            entry = self.cgroups.wrap(entry, cgroup)
            fds = () if relay is None else (relay.fileno(),)
            proc = spawn_session(entry, rdir, env, out, self.umask, fds)
        except BaseException:
            if netns:
                await asyncio.to_thread(self.networks.remove, request.launch_token)
            await asyncio.to_thread(self.cgroups.destroy, cgroup)
            raise
        finally:
            if out >= 0:
                os.close(out)
            if relay is not None:
                relay.close()  # the relay holds it now
        self._children[proc.pid] = proc
        self._watch_exit(proc.pid, request.service, request.replica_id)
        try:
            create_time = started(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            create_time = 0.0
        handle = LocalHandle(
            pid=proc.pid,
            create_time=create_time,
            port=port,
            dir=str(rdir),
            netns=netns,
            address=netns and address,
            service=request.service,
            replica_id=request.replica_id,
            zone=zone,
            spot=request.spot,
            cgroup=None if cgroup is None else str(cgroup),
        )
        self._hold(request.launch_token, handle)  # the zone's capacity counts it from now
        try:
            while not layout.setup_done.exists():
                code = proc.poll()
                if code is not None:
                    if layout.setup_done.exists():
                        break  # run already ended: poll() reports it
                    if proc.pid in self._preempted:
                        raise NoCapacity(self._preempted[proc.pid], zone, preempted=True)
                    raise TerminalError(
                        f"setup failed with exit code {code}{setup_missing(log)} (see "
                        f"`fleetserve logs {request.service} {request.replica_id}`)"
                    )
                await asyncio.sleep(self.poll_interval)
        except BaseException:
            await self.terminate(handle.to_json(), request.launch_token)
            raise
        # A user namespace's replica is reached through its relay's port on this machine.
        return Launched(handle=handle.to_json(), host=address, port=relay_port or port, zone=zone)

    async def poll(self, handle: str) -> InstanceState:
        h = LocalHandle.from_json(handle)
        why = self._preempted.get(h.pid)
        if why is not None:
            return InstanceState(InstanceKind.LOST, detail=why)
        child = self._children.get(h.pid)
        code: int | None = None
        if child is not None:
            code = child.poll()
            if code is None:
                return InstanceState(InstanceKind.RUNNING)
            self._children.pop(h.pid, None)
        elif (p := find_process(h.pid, h.create_time)) is not None:
            if not self._ours(p, h.create_time):
                return InstanceState(
                    InstanceKind.LOST, detail=f"pid {h.pid} belongs to another fleetserve home"
                )
            if h.service is not None and h.replica_id is not None:
                self._watch_exit(h.pid, h.service, h.replica_id)  # adopted: watched from now
            if h.zone is not None and not any(x.pid == h.pid for x in self.zones.held.values()):
                # Adopted after a controller restart: its zone counts it again.
                with contextlib.suppress(psutil.Error):
                    token = p.environ().get(TOKEN_ENV)
                    if token:
                        self._hold(token, h)
            return InstanceState(InstanceKind.RUNNING)
        recorded = ReplicaLayout(Path(h.dir)).exit_code
        with contextlib.suppress(OSError, ValueError):
            code = int(recorded.read_text().strip())
        if code is None:
            return InstanceState(InstanceKind.LOST, detail="the replica's process vanished")
        if code < 0:
            detail = f"killed by signal {signal.Signals(-code).name}"
        else:
            detail = f"exited with code {code}"
        return InstanceState(InstanceKind.EXITED, exit_code=code, detail=detail)

    def listening_ports(self, handle: str) -> list[int] | None:
        """The TCP ports the replica's processes (its leader and descendants) listen on, in
        its own network; None when its leader is gone or not ours."""
        h = LocalHandle.from_json(handle)
        leader = find_process(h.pid, h.create_time)
        if leader is None or not self._ours(leader, h.create_time):
            return None
        with contextlib.suppress(psutil.Error):
            return listening_ports([leader.pid, *(c.pid for c in leader.children(True))])
        return None

    def watch_exits(self, callback: ExitCallback) -> None:
        """`WatchesExits`: a replica whose process ends is reported at once (a pidfd per
        replica's leader process on the event loop), not at the next poll."""
        self._on_exit = callback

    def _watch_exit(self, pid: int, service: str, replica_id: ReplicaId) -> None:
        """Report the end of `pid` (a replica's leader) as soon as it happens: its pidfd
        becomes readable then (Linux 5.3 and later; elsewhere polling finds it)."""
        callback = self._on_exit
        if callback is None or pid in self._watched or not hasattr(os, "pidfd_open"):
            return
        try:
            loop = asyncio.get_running_loop()
            fd = os.pidfd_open(pid)
        except (OSError, RuntimeError):
            return  # already gone (the next poll sees it), or no loop to watch on
        try:
            loop.add_reader(fd, self._exited, loop, fd, pid, service, replica_id)
        except (OSError, ValueError, NotImplementedError):
            os.close(fd)
            return
        self._watched[pid] = fd

    def _exited(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        pid: int,
        service: str,
        replica_id: ReplicaId,
    ) -> None:
        loop.remove_reader(fd)
        os.close(fd)
        self._watched.pop(pid, None)
        if self._on_exit is not None:
            self._on_exit(service, replica_id)

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        h = LocalHandle.from_json(handle) if handle else None
        self.zones.held.pop(launch_token, None)
        if h is not None:
            self._preempted.pop(h.pid, None)
        await asyncio.to_thread(self._terminate_sync, h, launch_token)

    def _terminate_sync(self, h: LocalHandle | None, token: str) -> None:
        procs: dict[int, psutil.Process] = {}
        if h is not None:
            leader = find_process(h.pid, h.create_time)
            if leader is not None and self._ours(leader, h.create_time):
                procs[leader.pid] = leader
        # Its cgroup: recorded in the handle, else found by the token (a cut-short launch).
        cgroup = (h is not None and self.cgroups.ours(h.cgroup)) or self.cgroups.find(token)
        alive = self._stop_all(
            lambda env: env.get(TOKEN_ENV) == token and self._env_ours(env), procs, cgroup=cgroup
        )
        if h is not None:
            child = self._children.pop(h.pid, None)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1)
        if alive:
            pids = ", ".join(str(pid) for pid in alive)
            raise TerminalError(f"processes {pids} survived SIGKILL")
        if (h is not None and h.netns) or (h is None and self.networks.may_exist()):
            self.networks.remove(token)  # found by the token: also after a cut-short launch
        if h is not None:
            shutil.rmtree(h.dir, ignore_errors=True)

    def _stop_all(
        self,
        match: Callable[[dict[str, str]], bool] | None,
        extra: dict[int, psutil.Process] | None = None,
        rounds: int = 3,
        cgroup: Path | None = None,
    ) -> list[int]:
        """Stop every process that `match`es or is in `cgroup` (SIGTERM, the grace, SIGKILL),
        scanning again after each round: a process forked while the last one was stopping (the
        wrapper starting `run`) is found too. Then whatever is left in the cgroup is killed at
        once and the cgroup removed. Returns the pids that survived SIGKILL."""
        procs = dict(extra or {})
        alive: list[psutil.Process] = []
        for _ in range(rounds):
            if match is not None:
                procs.update({p.pid: p for p in processes_where(match)})
            procs.update(self.cgroups.members(cgroup))
            if not procs:
                break
            alive = stop_processes(list(procs.values()), self.grace_seconds)
            if alive:
                break
            procs = {}
        else:
            alive = processes_where(match) if match is not None else []
        left = self.cgroups.destroy(cgroup)
        return sorted({p.pid for p in alive} | set(left))

    # -- jobs on pool workers (fleetserve.infra.jobs) ---------------------------------------

    async def start_job(self, req: JobRequest) -> str:
        return await asyncio.to_thread(self.jobs.start, req)

    async def poll_job(self, handle: str) -> InstanceState:
        return self.jobs.poll(handle)

    async def wait_job(self, handle: str) -> None:
        await self.jobs.wait(handle)

    async def stop_job(self, handle: str | None, token: str) -> None:
        await asyncio.to_thread(self.jobs.stop, token, handle)

    def job_logs(
        self, pool: str, job_id: int, handle: str | None, follow: bool, tail: int | None
    ) -> AsyncIterator[str]:
        return read_lines(job_log(self.home, pool, job_id), follow, tail)

    async def find_job(self, pool: str, job_id: int, token: str, worker_handle: str) -> str | None:
        return await asyncio.to_thread(self.jobs.find, pool, job_id, token)

    def forget_service(self, service: str) -> None:
        shutil.rmtree(self.home / "replicas" / service, ignore_errors=True)

    async def sweep(self, known_tokens: set[str]) -> int:
        """Stop replica processes of this home (by its id, not its path) whose launch token no
        row knows (orphans)."""

        def orphan(env: dict[str, str]) -> bool:
            token = env.get(TOKEN_ENV)
            return (
                token is not None
                and bool(self.home_id)
                and self._env_ours(env)
                and token not in known_tokens
            )

        procs = await asyncio.to_thread(processes_where, orphan)
        stopped = len(procs)
        if procs:
            await asyncio.to_thread(self._stop_all, orphan)
        if self.home_id:
            # Replica cgroups no row knows: what is left in them (processes that cleared their
            # environment, so no token) is stopped, and they are removed.
            for cgroup in await asyncio.to_thread(self.cgroups.orphans, known_tokens):
                stopped += self.cgroups.populated(cgroup)
                await asyncio.to_thread(self._stop_all, None, None, 1, cgroup)
        networks = 0
        if self.home_id and self.networks.may_exist():
            networks = await asyncio.to_thread(self.networks.sweep, known_tokens)
        return stopped + networks

    def logs(
        self,
        service: str,
        replica_id: ReplicaId,
        follow: bool,
        handle: str | None = None,
        tail: int | None = None,
    ) -> AsyncIterator[str]:
        return read_lines(self.log_path(service, replica_id), follow, tail)
