"""Whether this process can give a replica a network of its own, and how (`kind`): a veth pair
into a named namespace as root with iproute2 (fleetserve.infra.netns), or an unprivileged user
+ network namespace (fleetserve.infra.userns).

Neutral (oshelpers): `fleetserve validate` asks the same question as the controller's `up`
(fleetserve.spec.admission) without importing the infras. Whether user namespaces can be made
is tried in a child process running fleetserve.infra.userns's own probe (`--probe`): kernel
settings, AppArmor and seccomp all decide it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

from fleetserve.core.errors import TerminalError

MODE_ENV = "FLEETSERVE_REPLICA_NETNS"
# auto: veth pairs as root, else an unprivileged user namespace with a relay (infra.userns)
MODES = ("auto", "veth", "userns")


def veth_available() -> bool:
    """Whether this process may make named namespaces and veth pairs (root, with iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


@functools.cache
def userns_available() -> bool:
    """Whether this user may make a user + network namespace here (tried, once, in a child
    process)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fleetserve.infra.userns", "--probe"],
            capture_output=True,
            timeout=20,
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def kind(mode: str = "auto") -> str | None:
    """How this process gives a replica a network of its own: "veth" (root), "userns" (an
    unprivileged user namespace and a relay), or None when it cannot."""
    if mode not in MODES:
        raise TerminalError(f"{MODE_ENV}={mode!r}: use one of {', '.join(MODES)}")
    if mode in ("auto", "veth") and veth_available():
        return "veth"
    if mode in ("auto", "userns") and userns_available():
        return "userns"
    return None
