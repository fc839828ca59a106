"""Controller settings, read once from the environment (FLEETSERVE_*)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_API_PORT = 46580


def fleetserve_home() -> Path:
    return Path(os.environ.get("FLEETSERVE_HOME") or Path.home() / ".fleetserve").expanduser()


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


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

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            home=fleetserve_home(),
            api_port=int(_float("FLEETSERVE_API_PORT", DEFAULT_API_PORT)),
            reconcile_interval=_float("FLEETSERVE_RECONCILE_INTERVAL", 1.0),
            probe_interval=_float("FLEETSERVE_PROBE_INTERVAL", 5.0),
            starting_probe_interval=_float("FLEETSERVE_STARTING_PROBE_INTERVAL", 1.0),
            failure_window=_float("FLEETSERVE_FAILURE_WINDOW", 180.0),
            terminate_grace=_float("FLEETSERVE_TERMINATE_GRACE", 10.0),
            max_concurrent_launches=int(_float("FLEETSERVE_MAX_LAUNCHES", 4)),
            lb_port_start=int(_float("FLEETSERVE_LB_PORT_START", 30001)),
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
