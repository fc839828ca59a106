"""Processes of replicas, jobs and load balancers on this machine: start one in a session of
its own, find them by what their environment carries, stop them (SIGTERM, then SIGKILL), and
the one rule that says which home a process belongs to (`of_home`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

# Every process a controller starts (replicas, jobs, load balancers) carries its home's id.
HOME_ID_ENV = "FLEETSERVE_HOME_ID"


def spawn_session(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    out_fd: int,
    umask: int | None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """A process in a session (process group) of its own, output to `out_fd`, no stdin: a
    replica or a job, stopped later as a group and by its tokens."""
    return subprocess.Popen(
        argv,
        pass_fds=pass_fds,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        umask=-1 if umask is None else umask,
    )


# A recorded start at or above this is from before starts were kept in seconds since boot:
# psutil's wall-clock create_time (about 1.7e9), which a clock step moves (below).
_WALL_CLOCK_START = 1e8


def started(p: psutil.Process) -> float:
    """When `p` started, in seconds since boot: with its pid, the identity of a process.

    psutil's create_time() adds the boot time that /proc/stat derives from the wall clock, so
    a clock step (NTP, a VM resumed from a snapshot) moves it for every process at once, and a
    process recorded before the step no longer matches itself after it. The kernel's start
    tick never moves."""
    try:
        stat = Path(f"/proc/{p.pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: reaped while read)
        raise psutil.NoSuchProcess(p.pid) from None
    # Fields after the command (which may hold spaces and ')'): state is field 3, starttime 22.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def started_as(p: psutil.Process, recorded: float) -> bool:
    """Whether `p` is the process whose start was recorded as `recorded` (by `started`, or,
    in a record from an older fleetserve, psutil's wall-clock create_time)."""
    if recorded >= _WALL_CLOCK_START:
        return abs(p.create_time() - recorded) < 1.5
    return abs(started(p) - recorded) < 0.05


def find_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid`, if it is still the one that started at `create_time` (`started`)."""
    try:
        p = psutil.Process(pid)
        if not started_as(p, create_time):
            return None  # the pid was reused
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def processes_where(match: Callable[[dict[str, str]], bool]) -> list[psutil.Process]:
    """Every live process (but this one) whose environment satisfies `match`."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if match(p.environ()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if not _gone(p)]
    return alive


def stop_processes(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM, wait up to `grace` seconds, SIGKILL; returns those that survived."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    alive = _wait_gone(procs, grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return _wait_gone(alive, 5)


def of_home(env: Mapping[str, str], home_id: str, legacy_home: str | None = None) -> bool:
    """Whether a process environment belongs to this home: it carries the home's id, or (with
    `legacy_home`, a database upgraded from before home ids) no home id at all and that home
    path. The one ownership rule: replicas, jobs and load balancers are adopted, stopped and
    swept by it."""
    if env.get(HOME_ID_ENV) == home_id:
        return True
    return (
        legacy_home is not None
        and HOME_ID_ENV not in env
        and env.get("FLEETSERVE_HOME") == legacy_home
    )


def owned_by(p: psutil.Process, home_id: str, legacy_home: str | None = None) -> bool:
    """Whether the process belongs to this home (`of_home`; another user's process never does:
    its environment cannot be read)."""
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        return False
    return of_home(env, home_id, legacy_home)


def process_alive(
    pid: int | None,
    create_time: float | None,
    home_id: str | None = None,
    legacy_home: str | None = None,
) -> bool:
    """Whether that process still runs (and, given `home_id`, was started by that home)."""
    if pid is None or create_time is None:
        return False
    p = find_process(pid, create_time)
    return p is not None and (home_id is None or owned_by(p, home_id, legacy_home))
