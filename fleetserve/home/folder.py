"""The home folder is the owner's alone: checked before anything in it is opened or trusted.

Another local user who creates the home first (in a shared folder such as /tmp), or plants a
file or symlink in it while it was open to them, must not get the owner to follow a symlink,
adopt a token they know, or write where they choose. So the home must be a real directory
owned by this user, and every entry of it that fleetserve opens must be owned by this user;
otherwise the controller refuses to start, saying which path and why. See docs/security.md.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil

from fleetserve.core.errors import FleetserveError
from fleetserve.oshelpers.procs import started_as

TOKEN_BYTES = 32
# Entries whose contents are trusted or written: checked one level down (and logs two).
_CHECKED_DIRS = ("logs", "lb", "replicas")


class UnsafeHome(FleetserveError):
    """The home, or something in it, is not this user's own."""

    kind = "unsafe_home"
    exit_code = 6


def _check_owned(path: Path, uid: int) -> os.stat_result:
    st = os.lstat(path)
    if st.st_uid != uid:
        raise UnsafeHome(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another user may "
            "have planted it; remove it (or choose another FLEETSERVE_HOME) and start again"
        )
    return st


def secure_home(home: Path) -> None:
    """Create the home 0700, or check an existing one: a directory (not a symlink) of this
    user, with every entry fleetserve uses owned by this user; then make it 0700 again."""
    uid = os.getuid()
    try:
        st = os.lstat(home)
    except FileNotFoundError:
        home.mkdir(parents=True, mode=0o700)
        st = os.lstat(home)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeHome(f"FLEETSERVE_HOME {home} is a symlink or not a directory")
    _check_owned(home, uid)
    os.chmod(home, 0o700)  # a directory of ours, checked above: no symlink to follow
    for entry in home.iterdir():
        _check_owned(entry, uid)
    for name in _CHECKED_DIRS:
        sub = home / name
        if not sub.is_dir() or sub.is_symlink():
            continue
        for entry in sub.iterdir():
            est = _check_owned(entry, uid)
            if name == "logs" and stat.S_ISDIR(est.st_mode):
                for inner in entry.iterdir():
                    _check_owned(inner, uid)
    for name in ("fleetserve.db", "fleetserve.db-wal", "fleetserve.db-shm", "api-token"):
        path = home / name
        if path.exists() and not path.is_symlink():
            os.chmod(path, 0o600)


def ensure_token(path: Path) -> str:
    """The API token, made (0600, atomically, never through a symlink) if there is none yet.
    An existing token file must be this user's and private, or it is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
        return token
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UnsafeHome(
            f"{path} is not a private file of this user (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): delete it to make a new token"
        )
    token = path.read_text().strip()
    if len(token) < 32:
        raise UnsafeHome(f"{path} holds no usable token: delete it to make a new one")
    return token


_SERVER_FILE = re.compile(r"server(-[0-9]{1,5})?\.json")
CONTROLLER = "fleetserve.api.server"  # the module a controller runs as (python -m ...)


@dataclass(frozen=True)
class RunningController:
    """A controller of a home that runs, as its server file says (checked to be alive)."""

    pid: int
    port: int
    host: str  # the address it listens on (0.0.0.0 for every interface, say)
    scheme: str  # http, or https with TLS
    ha: bool  # started with FLEETSERVE_HA (one of several on one database)
    file: Path

    @property
    def where(self) -> str:
        """Where it listens (what `server status` shows)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def url(self) -> str:
        """Where a client of this machine reaches it."""
        return local_url(self.scheme, self.host, self.port)


def local_url(scheme: str, host: str, port: int) -> str:
    """The URL a client on this machine uses for a controller listening on `host`: loopback
    for every interface, else the address itself (127.0.0.2, ::1, or one of this machine's)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def running_controllers(home: Path) -> list[RunningController]:
    """Every controller of this home that runs, whatever FLEETSERVE_HA and FLEETSERVE_API_PORT
    say here: server.json (a controller without high availability) and server-<port>.json
    (one per API port with it), each checked to name a live process started when it says.
    The one way `server stop`, `server status` and the client find them."""
    found = []
    try:
        names = sorted(p.name for p in home.iterdir() if _SERVER_FILE.fullmatch(p.name))
    except OSError:
        return []
    for name in names:
        path = home / name
        try:
            info = json.loads(path.read_text())
            p = psutil.Process(int(info["pid"]))
            # (and a controller's: a server file naming another process of this user, edited
            # or left from a crash whose pid came back, must not have it signalled)
            if not started_as(p, float(info["create_time"])) or CONTROLLER not in p.cmdline():
                continue
            found.append(
                RunningController(
                    pid=p.pid,
                    port=int(info["port"]),
                    host=str(info.get("host") or "127.0.0.1"),
                    scheme="https" if info.get("scheme") == "https" else "http",
                    ha=name != "server.json",
                    file=path,
                )
            )
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue
    return sorted(found, key=lambda c: (c.ha, c.port))
