"""Stopping the nginx master that a killed nginx driver left behind: a few OS calls, apart from
fleetserve.lb.nginx so that the controller (which calls it on `down`) does not import the
whole load balancer (aiohttp, the proxy) to reach it."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def stop_stale_nginx(home: Path) -> bool:
    """Stop the nginx master that a killed driver left in `home` (it still holds the port).
    nginx rewrites its environment for its process title, so it is found by its pid file and
    its command line, which names this home's config."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((home / "nginx.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"nginx" in cmdline and str(home / "nginx.conf").encode() in cmdline:
            os.kill(pid, signal.SIGQUIT)
            return True
    return False
