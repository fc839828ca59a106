"""The controller's settings, read once from the environment (FLEETSERVE_*): those every process
of the home shares (fleetserve.home.settings.HomeSettings: the home, the API's address, the
store, high availability), then the controller's own, checked when it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fleetserve.home.settings import (
    HomeSettings,
    env_bounded,
    env_choice,
    env_number,
    env_whole,
    home_fields,
)
from fleetserve.infra.cgroups import MODE_ENV as CGROUPS_ENV
from fleetserve.infra.cgroups import MODES as CGROUPS_MODES
from fleetserve.infra.zones import ZoneConfig, parse_zones
from fleetserve.store.url import resolve_db_url


@dataclass(frozen=True)
class Settings(HomeSettings):
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
    # The dashboard's charts: one point per this many seconds, an hour of them per service.
    history_step: float = 5.0
    lease_ttl: float = 6.0  # high availability's lease (HomeSettings.ha), in seconds
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
            return env_number(env, name, default)

        return cls(
            **home_fields(env),
            reconcile_interval=num("FLEETSERVE_RECONCILE_INTERVAL", 1.0),
            probe_interval=num("FLEETSERVE_PROBE_INTERVAL", 5.0),
            starting_probe_interval=num("FLEETSERVE_STARTING_PROBE_INTERVAL", 1.0),
            failure_window=num("FLEETSERVE_FAILURE_WINDOW", 180.0),
            terminate_grace=num("FLEETSERVE_TERMINATE_GRACE", 10.0),
            max_concurrent_launches=int(num("FLEETSERVE_MAX_LAUNCHES", 4)),
            lb_port_start=int(num("FLEETSERVE_LB_PORT_START", 30001)),
            replica_net=env.get("FLEETSERVE_REPLICA_NET") or "10.231.0.0/16",
            replica_netns=env.get("FLEETSERVE_REPLICA_NETNS") or "auto",
            cgroups=env_choice(env, CGROUPS_ENV, CGROUPS_MODES),
            autoscale_interval=num("FLEETSERVE_AUTOSCALE_INTERVAL", 1.0),
            # (also a replaced load balancer's drain: LbConfig.drain_seconds allows 0-3600)
            drain_seconds=env_bounded(env, "FLEETSERVE_DRAIN_SECONDS", 120.0, 0.0, 3600.0),
            launch_timeout=num("FLEETSERVE_LAUNCH_TIMEOUT", 1800.0),
            log_cap_bytes=int(num("FLEETSERVE_LOG_CAP_BYTES", 100 * 1024 * 1024)),
            max_body_bytes=int(num("FLEETSERVE_MAX_BODY_BYTES", 2 * 1024 * 1024)),
            parse_timeout=num("FLEETSERVE_PARSE_TIMEOUT", 5.0),
            local_zones=tuple(parse_zones(env.get("FLEETSERVE_LOCAL_ZONES"))),
            history_step=env_bounded(env, "FLEETSERVE_HISTORY_STEP", 5.0, 1.0, 60.0),
            lease_ttl=env_bounded(env, "FLEETSERVE_LEASE_TTL", 6.0, 2.0, 60.0),
            api_header_timeout=env_bounded(env, "FLEETSERVE_API_HEADER_TIMEOUT", 10.0, 0.5, 3600),
            api_max_connections=env_whole(env, "FLEETSERVE_API_MAX_CONNECTIONS", 512, 16, 100_000),
            api_max_client_connections=env_whole(
                env, "FLEETSERVE_API_MAX_CLIENT_CONNECTIONS", 32, 1, 100_000
            ),
        )

    def store_url(self) -> str | None:
        """The PostgreSQL URL of the store (from db_url, or read from db_url_file), or None
        for SQLite at db_path. A malformed URL or an unsafe file refuses in one line."""
        return resolve_db_url(self.db_url, self.db_url_file)
