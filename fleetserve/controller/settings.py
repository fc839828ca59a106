"""Controller settings, read once from the environment (FLEETSERVE_*)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetserve.core.errors import InvalidSpec

DEFAULT_API_PORT = 46580


def fleetserve_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("FLEETSERVE_HOME") or Path.home() / ".fleetserve").expanduser()


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidSpec(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class Settings:
    home: Path
    api_port: int = DEFAULT_API_PORT
    reconcile_interval: float = 1.0  # seconds between two rounds of a service's reconciler
    probe_interval: float = 5.0  # READY / NOT_READY replicas
    starting_probe_interval: float = 1.0  # STARTING replicas: notice readiness within a second
    failure_window: float = 180.0  # seconds of failing probes before a replica is FAILED_PROBING
    terminate_grace: float = 10.0  # SIGTERM, then SIGKILL after this many seconds
    max_concurrent_launches: int = 4
    lb_port_start: int = 30001
    lb_repush_interval: float = 10.0  # the set is pushed on every change, and again this often
    autoscale_interval: float = 1.0  # seconds between two autoscaler decisions
    drain_seconds: float = 120.0  # the longest wait for a scaled-down replica's requests

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
            reconcile_interval=num("FLEETSERVE_RECONCILE_INTERVAL", 1.0),
            probe_interval=num("FLEETSERVE_PROBE_INTERVAL", 5.0),
            starting_probe_interval=num("FLEETSERVE_STARTING_PROBE_INTERVAL", 1.0),
            failure_window=num("FLEETSERVE_FAILURE_WINDOW", 180.0),
            terminate_grace=num("FLEETSERVE_TERMINATE_GRACE", 10.0),
            max_concurrent_launches=int(num("FLEETSERVE_MAX_LAUNCHES", 4)),
            lb_port_start=int(num("FLEETSERVE_LB_PORT_START", 30001)),
            autoscale_interval=num("FLEETSERVE_AUTOSCALE_INTERVAL", 1.0),
            drain_seconds=num("FLEETSERVE_DRAIN_SECONDS", 120.0),
        )

    @property
    def db_path(self) -> Path:
        return self.home / "fleetserve.db"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def server_file(self) -> Path:
        return self.home / "server.json"
