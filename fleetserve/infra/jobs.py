"""Jobs on a pool's workers (local infra): each job is a process group started in its
worker's working folder, with its own log and a recorded exit code.

A job's processes carry the worker's launch token (stopping or preempting the worker stops its
jobs too, and the orphan sweep treats them as the worker's) and a job token of their own (a
cancel stops that job only). A small bash wrapper records the exit code, so a restarted
controller that adopts a running job (not its child any more) still learns how it ended.
Where its worker has a cgroup (fleetserve.infra.cgroups), a job runs in a cgroup of its own
inside it: a cancel kills that one, the worker's stop kills both, and processes that cleared
their environment (no tokens) go with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from fleetserve.core.errors import TerminalError
from fleetserve.infra.base import InstanceKind, InstanceState
from fleetserve.infra.cgroups import Cgroups, job_name
from fleetserve.oshelpers.procs import (
    HOME_ID_ENV,
    find_process,
    of_home,
    processes_where,
    spawn_session,
    started,
    stop_processes,
)

JOB_TOKEN_ENV = "FLEETSERVE_JOB_TOKEN"
_EXIT_CODE = "exit_code"
_JOB_ENTRY = """\
# Written by fleetserve: runs one job in its worker's working folder.
cd {workdir} || exit 1
bash {dir}/run.sh
rc=$?
echo $rc > {dir}/{exit_code}
exit $rc
"""


class WorkerBroken(TerminalError):
    """The worker cannot take jobs any more (its folder or actor is gone): replace it."""


@dataclass(frozen=True)
class JobRequest:
    pool: str
    job_id: int
    token: str  # the job's own
    worker_token: str  # its worker's launch token
    worker_handle: str  # its worker's handle (the infra's JSON text)
    run: str
    envs: dict[str, str] = field(default_factory=dict)


class JobRunner(Protocol):
    """What an infra offers pools: jobs on a worker (local: a process in the worker's folder;
    ray: a process the worker's actor starts on its node)."""

    async def start_job(self, req: JobRequest) -> str:
        """Start the job on its worker; returns the job's handle (JSON text)."""
        ...

    async def poll_job(self, handle: str) -> InstanceState: ...

    async def wait_job(self, handle: str) -> None:
        """Return once the job's process has ended (or its worker is gone)."""
        ...

    async def stop_job(self, handle: str | None, token: str) -> None:
        """Stop the job's processes (SIGTERM, then SIGKILL after the grace)."""
        ...

    def job_logs(
        self, pool: str, job_id: int, handle: str | None, follow: bool, tail: int | None
    ) -> AsyncIterator[str]: ...

    async def find_job(self, pool: str, job_id: int, token: str, worker_handle: str) -> str | None:
        """The handle of a job whose start a controller restart cut short: its process if
        it runs, its recorded end if it ended; None if it never started."""
        ...


@dataclass(frozen=True)
class JobHandle:
    pid: int
    create_time: float
    dir: str
    cgroup: str | None = None  # the job's cgroup, inside its worker's (where there is one)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobHandle:
        d = json.loads(text)
        return cls(int(d["pid"]), float(d["create_time"]), str(d["dir"]), d.get("cgroup"))


def job_dir(home: Path, pool: str, job_id: int) -> Path:
    return home / "replicas" / pool / "jobs" / str(job_id)


def job_log(home: Path, pool: str, job_id: int) -> Path:
    return home / "logs" / pool / f"job-{job_id}.log"


class LocalJobs:
    """Starts, polls, waits for and stops job processes (the local infra's part of pools)."""

    def __init__(
        self,
        home: Path,
        home_id: str,
        token_env: str,
        umask: int | None = None,
        grace_seconds: float = 10.0,
        cgroups: Cgroups | None = None,
    ) -> None:
        self.home = home
        self.cgroups = cgroups or Cgroups(home_id, home, "off")
        self.home_id = home_id
        self.token_env = token_env
        self.umask = umask
        self.grace_seconds = grace_seconds
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def _write(self, req: JobRequest) -> Path:
        d = job_dir(self.home, req.pool, req.job_id)
        if d.exists():
            shutil.rmtree(d)  # a requeued job starts afresh
        d.mkdir(parents=True, mode=0o700)
        (d / "run.sh").write_text(req.run)
        workdir = Path(json.loads(req.worker_handle).get("dir", "")) / "workdir"
        if not workdir.is_dir():
            raise WorkerBroken(f"the worker's folder {workdir} is gone")
        (d / "entry.sh").write_text(
            _JOB_ENTRY.format(
                workdir=shlex.quote(str(workdir)),
                dir=shlex.quote(str(d)),
                exit_code=_EXIT_CODE,
            )
        )
        return d

    def start(self, req: JobRequest) -> str:
        """Start the job; returns its handle (JSON text)."""
        d = self._write(req)
        log = job_log(self.home, req.pool, req.job_id)
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = dict(os.environ)
        env.update(req.envs)
        env[self.token_env] = req.worker_token
        env[JOB_TOKEN_ENV] = req.token
        if self.home_id:
            env[HOME_ID_ENV] = self.home_id
        # Its own cgroup inside its worker's, where the worker has one.
        worker_cgroup = self.cgroups.ours(json.loads(req.worker_handle).get("cgroup"))
        cgroup = None
        if worker_cgroup is not None:
            cgroup = self.cgroups.create(job_name(req.job_id, req.token), worker_cgroup)
        argv = self.cgroups.wrap(["bash", str(d / "entry.sh")], cgroup)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            proc = spawn_session(argv, d, env, fd, self.umask)
        except BaseException:
            self.cgroups.destroy(cgroup)
            raise
        finally:
            os.close(fd)
        self._children[proc.pid] = proc
        try:
            created = started(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            created = 0.0
        return JobHandle(
            proc.pid, created, str(d), None if cgroup is None else str(cgroup)
        ).to_json()

    def poll(self, handle: str) -> InstanceState:
        h = JobHandle.from_json(handle)
        child = self._children.get(h.pid)
        code: int | None = None
        if child is not None:
            code = child.poll()
            if code is None:
                return InstanceState(InstanceKind.RUNNING)
            self._children.pop(h.pid, None)
        elif h.pid > 0 and find_process(h.pid, h.create_time) is not None:
            return InstanceState(InstanceKind.RUNNING)
        with contextlib.suppress(OSError, ValueError):
            code = int((Path(h.dir) / _EXIT_CODE).read_text().strip())
        if code is None:
            return InstanceState(InstanceKind.LOST, detail="the job's process vanished")
        return InstanceState(InstanceKind.EXITED, exit_code=code, detail=f"exit code {code}")

    async def wait(self, handle: str, poll_interval: float = 0.5) -> None:
        """Return once the job's process has ended: at once through a pidfd where the kernel
        has them (no polling), else by polling."""
        h = JobHandle.from_json(handle)
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(h.pid)
        except (OSError, AttributeError):
            fd = None
        if fd is not None:
            ended = asyncio.Event()
            loop.add_reader(fd, ended.set)
            try:
                if self.poll(handle).kind is InstanceKind.RUNNING:
                    await ended.wait()
            finally:
                loop.remove_reader(fd)
                os.close(fd)
            child = self._children.get(h.pid)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1)  # reap it: its exit code, no zombie
            return
        while self.poll(handle).kind is InstanceKind.RUNNING:
            await asyncio.sleep(poll_interval)

    def _ours(self, token: str) -> Callable[[dict[str, str]], bool]:
        return lambda env: (
            env.get(JOB_TOKEN_ENV) == token and (not self.home_id or of_home(env, self.home_id))
        )

    def stop(self, token: str, handle: str | None = None) -> list[int]:
        """Stop every process of the job: those with its token and those in its cgroup
        (SIGTERM, then SIGKILL after the grace); then the cgroup is killed whole and removed.
        Returns the pids that survived."""
        recorded = JobHandle.from_json(handle).cgroup if handle else None
        cgroup = self.cgroups.ours(recorded) or self.cgroups.find(token)
        procs = {p.pid: p for p in processes_where(self._ours(token))}
        procs.update(self.cgroups.members(cgroup))
        alive = stop_processes(list(procs.values()), self.grace_seconds)
        left = self.cgroups.destroy(cgroup)
        for pid in list(self._children):
            if self._children[pid].poll() is not None:
                self._children.pop(pid, None)
        return sorted({p.pid for p in alive} | set(left))

    def find(self, pool: str, job_id: int, token: str) -> str | None:
        d = job_dir(self.home, pool, job_id)
        found = processes_where(self._ours(token))
        cgroup = self.cgroups.find(token)
        if found:
            first = min(found, key=started)  # the wrapper started first
            return JobHandle(
                first.pid, started(first), str(d), None if cgroup is None else str(cgroup)
            ).to_json()
        if (d / _EXIT_CODE).exists():
            return JobHandle(0, 0.0, str(d)).to_json()  # it ended: poll reads the exit code
        return None

    def forget(self, pool: str, job_id: int) -> None:
        shutil.rmtree(job_dir(self.home, pool, job_id), ignore_errors=True)
