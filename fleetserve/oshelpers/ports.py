"""TCP ports of this machine: whether one is free, a free one, who listens on one."""

from __future__ import annotations

import contextlib
import socket

import psutil

from fleetserve.core.errors import TerminalError


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind `host`:`port` now (the address it will bind: 0.0.0.0 is
    taken by any listener on that port). Never with SO_REUSEPORT: that would call a port free
    that another listener of this user shares out."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def fixed_port_taken(port: int) -> str | None:
    """Why a replica's server could not listen on a port its spec fixes, or None. Checked
    the way the server binds it (every address, 0.0.0.0), and only a listener takes a port:
    a service on that port taken down a moment ago leaves connections in TIME_WAIT (for a
    minute) that fail a test bind, yet a server that sets SO_REUSEADDR (most do) or
    SO_REUSEPORT, as its predecessor did, binds beside them."""
    if port_free(port, "0.0.0.0"):
        return None
    holders = listeners_on(port)
    if not holders:
        return None  # only connections left, no listener: the server's own bind decides
    known = sorted({p for p in holders if p is not None})
    who = f" (listening: pid {', '.join(map(str, known))})" if known else ""
    return f"port {port} (fixed by the spec) is already in use on this machine{who}"


def free_port(avoid: set[int] | None = None) -> int:
    """A port that nothing listens on now (the kernel's pick), not in `avoid`."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not avoid or port not in avoid:
            return port
    raise TerminalError("could not find a free port")


def listeners_on(port: int) -> list[int | None]:
    """The pids listening on TCP `port` (None for a process this user may not see)."""
    found: list[int | None] = []
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                found.append(c.pid)
    return found
