"""One round_robin rotation for all the processes of a load balancer (fleetserve.lb.workers).

The kernel spreads connections over the processes, so a rotation of each process's own gave
sequences like `2 1 1 2` where docs/load-balancer.md promises each replica in turn. The
primary makes one 8-byte counter in shared memory (a memfd) and hands its descriptor to each
worker it starts; every choice takes the next number under a POSIX record lock (per process,
so the processes exclude each other), about two system calls per request. Only round_robin,
and least_load (plain or instance-aware) when replicas tie, with several processes use it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

FD_ENV = "FLEETSERVE_LB_ROTATION_FD"  # the counter's descriptor, from the primary to a worker
_COUNT = struct.Struct("=Q")


class SharedCounter:
    """A counter in shared memory that several processes take numbers from, each once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, _COUNT.size)

    @classmethod
    def create(cls) -> SharedCounter:
        fd = os.memfd_create("fleetserve-lb-rotation")
        os.ftruncate(fd, _COUNT.size)
        return cls(fd)

    def take(self) -> int:
        """The next number (0, 1, 2, ...): no two processes get the same one."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            (value,) = _COUNT.unpack_from(self._map)
            _COUNT.pack_into(self._map, 0, (value + 1) & 0xFFFF_FFFF_FFFF_FFFF)
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        return int(value)
