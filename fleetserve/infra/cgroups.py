"""Each replica and each job of the local infra in a cgroup (v2) of its own, stopped whole.

The launch-token scan (fleetserve.infra.local) finds a replica's processes by the token in
their environment. A process that clears its environment (`env -i`) and leaves its session
(`setsid`, a double fork, `nohup`, a daemon) carries no token and escapes it. It cannot leave
its cgroup: every process forks into its parent's cgroup, whatever session, user or network
namespace it enters. So where this user may create cgroups in the cgroup v2 hierarchy (root;
a systemd unit with `Delegate=yes`), each replica starts in a cgroup of its own (a small
`sh` wrapper writes its pid to the cgroup's `cgroup.procs`, then execs the replica's command,
before any of the replica's code runs), and stopping it kills the cgroup (`cgroup.kill`, or
SIGKILL to each member until it is empty on kernels before 5.14) and removes it.

Layout, under the cgroup the controller itself runs in (its `0::` line in /proc/self/cgroup):

    fleetserve-<home id>/                         one per home (removed once empty)
      r.<service>.<replica id>.<launch token>     a replica, or a pool's worker
        job.<job id>.<job token>                  a job on that worker

The names are derived from what the store keeps (a restarted controller finds a replica's
cgroup from its row, and the handle also records the path), and the home id and the tokens
keep two homes, two services, or two launches of one replica from ever sharing one. The
home's file `cgroup` lists where its cgroups were made: a controller restarted in another
cgroup (another login session, say) still finds and sweeps those.

Elsewhere (no cgroup v2, no permission to create cgroups, FLEETSERVE_CGROUPS=off) the token
scan alone stops processes, as before; `fleetserve server status` and /health say which.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

MODE_ENV = "FLEETSERVE_CGROUPS"  # "auto" (default): cgroups where possible; "off": never
MODES = ("auto", "off")

# Enter the cgroup whose cgroup.procs is $0, then become the command. A failure to enter is
# said in the log and the command runs anyway (stopped by its tokens only, as before).
_ENTER = (
    '{ echo $$ > "$0"; } 2>/dev/null || echo "[fleetserve] could not enter cgroup '
    '${0%/cgroup.procs}: its processes are stopped by their tokens only" >&2; exec "$@"'
)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,240}")


def own_cgroup() -> tuple[Path | None, str]:
    """The directory of this process's cgroup in the cgroup v2 hierarchy, or None and why."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as e:
        return None, f"cannot read /proc/self/cgroup ({e.strerror})"
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None, "this machine has no cgroup v2 hierarchy (cgroup v1 only)"
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as e:
        return None, f"cannot read /proc/self/mountinfo ({e.strerror})"
    for line in mountinfo:
        fields = line.split()
        if " - cgroup2 " not in line or len(fields) < 5:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if rel != root and not rel.startswith(root.rstrip("/") + "/"):
            continue  # this mount shows another part of the hierarchy
        here = Path(point) / rel[len(root) :].lstrip("/")
        if (here / "cgroup.procs").is_file():
            return here, ""
    return None, f"this process's cgroup ({rel}) is not mounted here (no cgroup2 mount shows it)"


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo (spaces and the like written as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def replica_name(service: str, replica_id: int, token: str) -> str:
    return _checked(f"r.{service}.{replica_id}.{token}")


def job_name(job_id: int, token: str) -> str:
    return _checked(f"job.{job_id}.{token}")


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name) or name.startswith(".."):
        raise ValueError(f"not a cgroup name fleetserve makes: {name!r}")
    return name


class Cgroups:
    """A home's cgroups: made, entered, listed, killed and removed. Whether cgroups can be
    used here is found once, on first use, by making the home's cgroup and moving a short
    `sh` into a probe cgroup under it."""

    def __init__(
        self, home_id: str, home: Path, mode: str = "auto", base: Path | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, not {mode!r}")
        ident = home_id or hashlib.sha256(str(home).encode()).hexdigest()[:12]
        self.name = _checked(f"fleetserve-{ident}")
        self.record = home / "cgroup"  # where this home's cgroups were made (one a line)
        self.mode = mode
        self._base = base  # the parent of the home's cgroup; None: this process's cgroup
        self._lock = threading.Lock()
        self._state: tuple[Path | None, str] | None = None

    # -- whether cgroups are used ----------------------------------------------------------

    def _check(self) -> tuple[Path | None, str]:
        with self._lock:
            if self._state is None:
                self._state = self._probe()
            return self._state

    def _probe(self) -> tuple[Path | None, str]:
        if self.mode == "off":
            return None, f"{MODE_ENV}=off"
        base, why = (self._base, "") if self._base is not None else own_cgroup()
        if base is None:
            return None, why
        home = base / self.name
        try:
            home.mkdir(exist_ok=True)
        except OSError as e:
            return None, f"cannot create cgroup {home} ({e.strerror})"
        if not (home / "cgroup.procs").is_file():
            with contextlib.suppress(OSError):
                home.rmdir()
            return None, f"{base} is not in a cgroup v2 hierarchy"
        probe = home / f"probe.{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            done = subprocess.run(
                ["/bin/sh", "-c", 'echo $$ > "$0"', str(probe / "cgroup.procs")],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"cannot use cgroup {home} ({e})"
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()
            with contextlib.suppress(OSError):
                home.rmdir()  # made again by the first replica's `create`; kept if in use
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip().splitlines()
            return None, f"cannot move a process into cgroup {probe} ({' '.join(message[-1:])})"
        return home, ""

    @property
    def home(self) -> Path | None:
        """The home's cgroup, or None where cgroups cannot be used here."""
        return self._check()[0]

    def describe(self) -> str:
        """One line for `server status`: how a replica's and a job's processes are stopped."""
        home, why = self._check()
        if home is not None:
            return f"cgroup v2: each replica and job in its own cgroup, under {home}"
        return (
            f"token scan only ({why}): a process that clears its environment and leaves "
            "its session can outlive its replica or job"
        )

    # -- one replica's or job's cgroup -----------------------------------------------------

    def create(self, name: str, parent: Path | None = None) -> Path | None:
        """Make the cgroup `name` (under `parent`, else under the home's); None where cgroups
        cannot be used, or it could not be made (the token scan stops its processes then)."""
        home = self.home
        if home is None:
            return None
        path = (parent or home) / _checked(name)
        if parent is None:
            self._remember(home)
        with self._lock:  # `remove` may take away an empty home's cgroup meanwhile
            for _ in range(2):
                try:
                    home.mkdir(exist_ok=True)
                    path.mkdir(exist_ok=True)
                    return path
                except FileNotFoundError:
                    if parent is not None:
                        return None  # the worker's cgroup is gone
                except OSError:
                    return None
        return None

    def _recorded(self) -> list[Path]:
        """The home's cgroups that the record names and that still exist."""
        try:
            lines = self.record.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            p = Path(line.strip())
            if p.is_absolute() and p.name == self.name and (p / "cgroup.procs").is_file():
                out.append(p)
        return out

    def _remember(self, home: Path) -> None:
        """Add `home` to the record (0600, replaced atomically, never through a symlink)."""
        known = self._recorded()
        if home in known:
            return
        tmp = self.record.with_name(f".{self.record.name}.{os.getpid()}")
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"{p}\n" for p in [*known, home]))
            os.replace(tmp, self.record)

    def homes(self) -> list[Path]:
        """This home's cgroup here, then those of earlier controllers (in other cgroups)."""
        home = self.home
        if home is None:
            return []
        return [home, *(p for p in self._recorded() if p != home)]

    @staticmethod
    def wrap(argv: list[str], path: Path | None) -> list[str]:
        """`argv`, run in cgroup `path` (as is without one): its pid and start time stay."""
        if path is None:
            return argv
        return ["/bin/sh", "-c", _ENTER, str(path / "cgroup.procs"), *argv]

    def ours(self, path: str | Path | None) -> Path | None:
        """A recorded cgroup path, if it is one of this home's (a handle is not trusted to
        name some other cgroup)."""
        if path is None:
            return None
        p = Path(path)
        if not p.is_absolute() or ".." in p.parts:
            return None
        if p.parent.name == self.name and p.name.startswith("r."):
            return p
        if p.parent.parent.name == self.name and p.parent.name.startswith("r."):
            return p if p.name.startswith("job.") else None
        return None

    def find(self, token: str) -> Path | None:
        """The cgroup of the replica or job with this token (a handle-less stop: a launch cut
        short, a job whose start a restart cut short)."""
        if not token:
            return None
        end = f".{token}"
        for home in self.homes():
            with contextlib.suppress(OSError):
                for child in home.iterdir():
                    if not child.is_dir() or not child.name.startswith("r."):
                        continue
                    if child.name.endswith(end):
                        return child
                    for job in child.iterdir():
                        if not job.is_dir() or not job.name.startswith("job."):
                            continue
                        if job.name.endswith(end):
                            return job
        return None

    @staticmethod
    def pids(path: Path) -> list[int]:
        """Every process in the cgroup and the cgroups under it."""
        found: list[int] = []
        with contextlib.suppress(OSError):
            for d, _, _ in os.walk(path):
                with contextlib.suppress(OSError, ValueError):
                    text = (Path(d) / "cgroup.procs").read_text()
                    found += [int(x) for x in text.split()]
        return found

    def members(self, path: Path | None) -> dict[int, psutil.Process]:
        import psutil  # here: the rest of this module needs the standard library only

        out: dict[int, psutil.Process] = {}
        if path is None:
            return out
        for pid in self.pids(path):
            with contextlib.suppress(psutil.Error):
                out[pid] = psutil.Process(pid)
        return out

    @staticmethod
    def populated(path: Path) -> bool:
        try:
            events = (path / "cgroup.events").read_text()
        except FileNotFoundError:
            return False
        except OSError:
            return bool(Cgroups.pids(path))
        return "populated 1" in events

    def kill(self, path: Path) -> None:
        """SIGKILL every process in the cgroup and under it, at once (`cgroup.kill`), or one
        by one until none is left where the kernel has no cgroup.kill (before 5.14). Only a
        replica's or job's cgroup of this home: never one above it."""
        if self.ours(path) is None:
            raise ValueError(f"not a cgroup of this home's replicas or jobs: {path}")
        try:
            (path / "cgroup.kill").write_text("1")
            return
        except FileNotFoundError:
            if not path.exists():
                return
        except OSError:
            pass
        self.kill_each(path)

    def kill_each(self, path: Path, rounds: int = 50) -> None:
        """Without `cgroup.kill`: freeze the cgroup (no more forks; Linux 5.2 and later),
        SIGKILL each member (a frozen process dies of it), again until none is left."""
        if self.ours(path) is None:
            raise ValueError(f"not a cgroup of this home's replicas or jobs: {path}")
        with contextlib.suppress(OSError):
            (path / "cgroup.freeze").write_text("1")
        for _ in range(rounds):
            pids = self.pids(path)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def destroy(self, path: Path | None, timeout: float = 5.0) -> list[int]:
        """Kill every process left in the cgroup, wait for it to empty and remove it (and the
        home's cgroup, once that is empty). Returns the pids still in it after `timeout`."""
        if path is None or self.ours(path) is None or not path.exists():
            return []
        self.kill(path)
        deadline = time.monotonic() + timeout
        while self.populated(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = self.pids(path)
        if left:
            return left
        self.remove(path)
        return []

    def remove(self, path: Path) -> None:
        """Remove an empty cgroup and those under it, then the home's if nothing is left."""
        with contextlib.suppress(OSError):
            for d, _, _ in os.walk(path, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        if path.parent.name != self.name:
            return  # a job's: its worker's stays
        with self._lock, contextlib.suppress(OSError):
            path.parent.rmdir()  # fails (busy, not empty) while another replica has one: kept

    def orphans(self, known_tokens: set[str]) -> list[Path]:
        """This home's replica cgroups whose launch token no row knows (and empty probes a
        crashed controller left)."""
        out: list[Path] = []
        for home in self.homes():
            with contextlib.suppress(OSError):
                for child in home.iterdir():
                    if not child.is_dir():
                        continue
                    if child.name.startswith("r."):
                        if child.name.rsplit(".", 1)[1] not in known_tokens:
                            out.append(child)
                    elif child.name.startswith("probe."):
                        with contextlib.suppress(OSError):
                            child.rmdir()
            if home != self.home:
                with self._lock, contextlib.suppress(OSError):
                    home.rmdir()  # an earlier controller's, now empty
        return out
