"""Acting as another local user in tests (root only): `nobody` listening on a port."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fleetserve.core.sockets import listener_uids

NOBODY = 65534


@contextmanager
def nobody_listening(port: int, seconds: float = 30) -> Iterator[None]:
    """`nobody` listens on 127.0.0.1:`port` (and answers nothing) while the block runs."""
    script = (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep({seconds})"
    )
    proc = subprocess.Popen(["/usr/bin/python3", "-c", script], user="nobody", cwd="/")
    try:
        deadline = time.monotonic() + 10
        while not listener_uids(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield
    finally:
        proc.kill()
        proc.wait()
