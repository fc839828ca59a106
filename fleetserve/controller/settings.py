"""Controller settings, read once from the environment (FLEETSERVE_*)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleetserve.core.errors import InvalidSpec
from fleetserve.infra.cgroups import MODE_ENV as CGROUPS_ENV
from fleetserve.infra.cgroups import MODES as CGROUPS_MODES
from fleetserve.infra.zones import ZoneConfig, parse_zones
from fleetserve.store.url import resolve_db_url

DEFAULT_API_PORT = 46580


def fleetserve_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("FLEETSERVE_HOME") or Path.home() / ".fleetserve").expanduser()


# A number as people write one in ASCII (Python's float() also takes '1_0', ' 5', 'inf', 'nan'
# and other scripts' digits, none of which a setting should mean).
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if not _NUMBER.fullmatch(raw):
        raise InvalidSpec(f"{name}={raw[:40]!r} is not a number")
    return float(raw)


def _bounded(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    value = _float(env, name, default)
    if not lo <= value <= hi:
        raise InvalidSpec(f"{name}={env.get(name, '')[:40]} is out of range: {lo:g} to {hi:g}")
    return value


def _whole(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"[0-9]{1,9}", raw):
        raise InvalidSpec(f"{name}={raw[:40]!r} is not a whole number")
    if not lo <= int(raw) <= hi:
        raise InvalidSpec(f"{name}={raw} is out of range: {lo} to {hi}")
    return int(raw)


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidSpec(f"{name}={raw!r}: use 1 or 0")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (the first when unset)."""
    raw = (env.get(name) or "").strip().lower() or choices[0]
    if raw not in choices:
        raise InvalidSpec(f"{name}={raw!r}: use {' or '.join(choices)}")
    return raw


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class Settings:
    home: Path
    api_port: int = DEFAULT_API_PORT
    # Where the REST API listens. Anything but loopback needs TLS (a cert and key) and, like
    # every call but /health, the token.
    api_host: str = "127.0.0.1"
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides loopback ones
    reconcile_interval: float = 1.0  # seconds between two rounds of a service's reconciler
    probe_interval: float = 5.0  # READY / NOT_READY replicas
    starting_probe_interval: float = 1.0  # STARTING replicas: notice readiness within a second
    failure_window: float = 180.0  # seconds of failing probes before a replica is FAILED_PROBING
    terminate_grace: float = 10.0  # SIGTERM, then SIGKILL after this many seconds
    max_concurrent_launches: int = 4
    lb_port_start: int = 30001
    # Fixed-port fleets on the local infra: each replica's veth /30 comes from this range.
    replica_net: str = "10.231.0.0/16"
    # How: "veth" (root), "userns" (a normal user: a user namespace and a relay), or "auto".
    replica_netns: str = "auto"
    # Each local replica and job in a cgroup of its own where possible ("auto"), or never
    # ("off": the launch-token scan alone stops their processes). fleetserve.infra.cgroups.
    cgroups: str = "auto"
    lb_repush_interval: float = 10.0  # the set is pushed on every change, and again this often
    autoscale_interval: float = 1.0  # seconds between two autoscaler decisions
    drain_seconds: float = 120.0  # the longest wait for a scaled-down replica's requests
    launch_timeout: float = 1800.0  # setup + start of one replica; then FAILED_PROVISION
    log_cap_bytes: int = 100 * 1024 * 1024  # per log file (replica, LB, controller), rotated
    max_body_bytes: int = 2 * 1024 * 1024  # REST request bodies; larger ones get 413
    parse_timeout: float = 5.0  # seconds a service YAML may take to parse and check
    # The local infra's zones (FLEETSERVE_LOCAL_ZONES; fleetserve.infra.zones): one unlimited
    # zone, `local`, by default.
    local_zones: tuple[ZoneConfig, ...] = (ZoneConfig("local"),)
    # The store (docs/scaling.md): PostgreSQL at FLEETSERVE_DB_URL (kept out of repr: it may
    # hold a password), or at the URL in the 0600 file FLEETSERVE_DB_URL_FILE (read by the
    # controller only, see store_url); neither: SQLite at db_path.
    db_url: str | None = field(default=None, repr=False)
    db_url_file: Path | None = None
    # The dashboard's charts: one point per this many seconds, an hour of them per service.
    history_step: float = 5.0
    # High availability (docs/scaling.md): several controllers on one database, one active
    # through a lease of `lease_ttl` seconds, the others standbys that take over.
    ha: bool = False
    lease_ttl: float = 6.0
    # The API's connections (fleetserve.api.connections): the time a request's head (and a
    # TLS handshake) may take, all connections, and those of one client before its token.
    api_header_timeout: float = 10.0
    api_max_connections: int = 512
    api_max_client_connections: int = 32

    @classmethod
    def from_env(cls) -> Settings:
        return cls.from_env_dict(os.environ)

    @classmethod
    def from_env_dict(cls, env: Mapping[str, str]) -> Settings:
        def num(name: str, default: float) -> float:
            return _float(env, name, default)

        return cls(
            home=fleetserve_home(env),
            api_port=int(num("FLEETSERVE_API_PORT", DEFAULT_API_PORT)),
            api_host=env.get("FLEETSERVE_API_HOST") or "127.0.0.1",
            tls_certfile=env.get("FLEETSERVE_TLS_CERTFILE") or None,
            tls_keyfile=env.get("FLEETSERVE_TLS_KEYFILE") or None,
            allowed_hosts=tuple(
                h.strip() for h in env.get("FLEETSERVE_ALLOWED_HOSTS", "").split(",") if h.strip()
            ),
            reconcile_interval=num("FLEETSERVE_RECONCILE_INTERVAL", 1.0),
            probe_interval=num("FLEETSERVE_PROBE_INTERVAL", 5.0),
            starting_probe_interval=num("FLEETSERVE_STARTING_PROBE_INTERVAL", 1.0),
            failure_window=num("FLEETSERVE_FAILURE_WINDOW", 180.0),
            terminate_grace=num("FLEETSERVE_TERMINATE_GRACE", 10.0),
            max_concurrent_launches=int(num("FLEETSERVE_MAX_LAUNCHES", 4)),
            lb_port_start=int(num("FLEETSERVE_LB_PORT_START", 30001)),
            replica_net=env.get("FLEETSERVE_REPLICA_NET") or "10.231.0.0/16",
            replica_netns=env.get("FLEETSERVE_REPLICA_NETNS") or "auto",
            cgroups=_choice(env, CGROUPS_ENV, CGROUPS_MODES),
            autoscale_interval=num("FLEETSERVE_AUTOSCALE_INTERVAL", 1.0),
            drain_seconds=num("FLEETSERVE_DRAIN_SECONDS", 120.0),
            launch_timeout=num("FLEETSERVE_LAUNCH_TIMEOUT", 1800.0),
            log_cap_bytes=int(num("FLEETSERVE_LOG_CAP_BYTES", 100 * 1024 * 1024)),
            max_body_bytes=int(num("FLEETSERVE_MAX_BODY_BYTES", 2 * 1024 * 1024)),
            parse_timeout=num("FLEETSERVE_PARSE_TIMEOUT", 5.0),
            local_zones=tuple(parse_zones(env.get("FLEETSERVE_LOCAL_ZONES"))),
            db_url=env.get("FLEETSERVE_DB_URL") or None,
            db_url_file=Path(env["FLEETSERVE_DB_URL_FILE"])
            if env.get("FLEETSERVE_DB_URL_FILE")
            else None,
            history_step=_bounded(env, "FLEETSERVE_HISTORY_STEP", 5.0, 1.0, 60.0),
            ha=_flag(env, "FLEETSERVE_HA"),
            lease_ttl=_bounded(env, "FLEETSERVE_LEASE_TTL", 6.0, 2.0, 60.0),
            api_header_timeout=_bounded(env, "FLEETSERVE_API_HEADER_TIMEOUT", 10.0, 0.5, 3600),
            api_max_connections=_whole(env, "FLEETSERVE_API_MAX_CONNECTIONS", 512, 16, 100_000),
            api_max_client_connections=_whole(
                env, "FLEETSERVE_API_MAX_CLIENT_CONNECTIONS", 32, 1, 100_000
            ),
        )

    @property
    def db_path(self) -> Path:
        return self.home / "fleetserve.db"

    def store_url(self) -> str | None:
        """The PostgreSQL URL of the store (from db_url, or read from db_url_file), or None
        for SQLite at db_path. A malformed URL or an unsafe file refuses in one line."""
        return resolve_db_url(self.db_url, self.db_url_file)

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def server_file(self) -> Path:
        """Where the running controller says who it is. With high availability several
        controllers share a home, one API port each: one file (and lock) per port."""
        return self.home / (f"server-{self.api_port}.json" if self.ha else "server.json")

    @property
    def controller_log(self) -> Path:
        """The controller's log; one per API port with high availability."""
        name = f"controller-{self.api_port}.log" if self.ha else "controller.log"
        return self.logs_dir / name

    @property
    def lock_file(self) -> Path:
        return self.home / (f"server-{self.api_port}.lock" if self.ha else "server.lock")

    @property
    def token_file(self) -> Path:
        """The API token (0600): the CLI and SDK of this user read it."""
        return self.home / "api-token"

    @property
    def api_scheme(self) -> str:
        return "https" if self.tls_certfile else "http"

    def check_exposure(self) -> None:
        """An API beyond loopback only with TLS: the token must not cross a network in clear."""
        if is_loopback(self.api_host):
            return
        if not (self.tls_certfile and self.tls_keyfile):
            raise InvalidSpec(
                f"listening on {self.api_host} needs TLS: pass --tls-cert and --tls-key "
                "(clients then need the token, and the CA file if the cert is private)"
            )
        for path in (self.tls_certfile, self.tls_keyfile):
            if not Path(path).is_file():
                raise InvalidSpec(f"TLS file {path} does not exist")
