"""Who listens on a local TCP port: read from /proc/net/tcp{,6}, which every user may read.

Used wherever a secret is about to be sent to, or trust given to, "whatever answers on port
P of this machine": the token to the controller, the LB's wake-up call, a replica's probe.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit


def listener_uids(port: int) -> set[int]:
    """The uids owning TCP sockets that listen on `port` (any address), from /proc/net/tcp
    and tcp6, which every user may read: who answers there, without needing root."""
    uids: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) < 8 or fields[3] != "0A":  # 0A: LISTEN
                        continue
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        uids.add(int(fields[7]))
        except OSError:
            continue
    return uids


def loopback_port(url: str) -> int | None:
    """The port of a loopback URL (127.x, localhost, ::1), None for any other URL."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host.startswith("127.") or host in ("localhost", "::1"):
        return parts.port or (443 if parts.scheme == "https" else 80)
    return None


def held_by_me(port: int) -> bool:
    """Whether the port's listeners, and there is at least one, are all this user's."""
    return listener_uids(port) == {os.getuid()}
