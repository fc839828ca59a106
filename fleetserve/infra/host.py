"""This host's identity, recorded beside every process a controller starts on it (a local
replica, a load balancer): a pid and a start tick name a process only on the host that
recorded them. Controllers of one high-availability deployment on different hosts share a
database (docs/scaling.md): each adopts, probes or stops only what its own host runs.

`FLEETSERVE_HOST_ID` if set (for tests, and for machines cloned with the same host name and
machine id), else the host name and the machine id (/etc/machine-id: stable across reboots,
so a rebooted controller still recovers its own records; the processes of before the reboot
are found dead by their start ticks, as after any restart), or the boot id where there is no
machine id.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from fleetserve.core.errors import InvalidSpec

HOST_ID_ENV = "FLEETSERVE_HOST_ID"
MAX_HOST_ID = 128  # the store's column (services.lb_host, replicas.host)
_MACHINE_IDS = (
    Path("/etc/machine-id"),
    Path("/var/lib/dbus/machine-id"),
    Path("/proc/sys/kernel/random/boot_id"),
)


def host_id(env: Mapping[str, str] | None = None, sources: tuple[Path, ...] = _MACHINE_IDS) -> str:
    """This host's id: FLEETSERVE_HOST_ID, else `<hostname>:<machine id>`."""
    env = os.environ if env is None else env
    given = (env.get(HOST_ID_ENV) or "").strip()
    if given:
        if len(given) > MAX_HOST_ID or not given.isprintable():
            raise InvalidSpec(
                f"{HOST_ID_ENV}: at most {MAX_HOST_ID} printable characters ({len(given)} given)"
            )
        return given
    machine = ""
    for source in sources:
        try:
            machine = source.read_text().strip()[:60]
        except OSError:
            continue
        if machine:
            break
    name = socket.gethostname()[:64] or "localhost"
    return f"{name}:{machine}" if machine else name


def elsewhere(recorded: str | None, mine: str | None) -> bool:
    """Whether a process recorded on host `recorded` runs on another host than `mine`. A
    record without a host (made before hosts were recorded) is of this host, and so is every
    record when this side keeps no host (an infra whose replicas are not local processes)."""
    return recorded is not None and mine is not None and recorded != mine


def host_of(infra: object) -> str | None:
    """The host whose processes an infra's replicas are (its `host`: the local infra), or
    None when they are not processes of a controller's host (Ray's actors)."""
    host = getattr(infra, "host", None)
    return host if isinstance(host, str) else None
