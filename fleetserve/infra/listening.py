"""The TCP ports a set of processes listen on, read from /proc: each process's own network
namespace's tables (/proc/<pid>/net/tcp, tcp6), so a replica in a namespace of its own is
read as well as one on this machine's network. Said when a readiness probe cannot connect
(the server listens, but on another port than the one probed)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _listening(pid: int, inodes: set[str]) -> set[int]:
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)  # the header
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[3] == _LISTEN and cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def listening_ports(pids: Iterable[int]) -> list[int]:
    """The TCP ports these processes listen on (those this user may read), sorted."""
    ports: set[int] = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        if inodes:
            ports |= _listening(pid, inodes)
    return sorted(ports)
