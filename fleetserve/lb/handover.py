"""A load balancer hands its listening sockets to the one that replaces it.

A load balancer with new settings starts beside the old one on the same port, then the old one
stops. With SO_REUSEPORT alone each process has sockets of its own in the port's group, and the
kernel spreads new connections over all of them: the connections that reach the old process's
queues between its last accept and its close are reset by the kernel at the close (the client
sees a connection reset, or one closed without an answer). So the new load balancer does not
make sockets of its own: it asks the old one for its sockets and listens on the same ones
(the same queues). The old one then stops accepting and closes its descriptors; whatever waits
in the queues is the new one's to accept. (Linux's `net.ipv4.tcp_migrate_req` would move the
queued connections instead; it is off by default and needs root.)

The two meet on an abstract Unix socket (SOCK_SEQPACKET) named after the user, the service and
the address: a name, not a file, so no path length or stale file to clean. Either side reads
the other's credentials (SO_PEERCRED) and talks only to a process of its own user: another
user's process can neither take the port's sockets nor pass its own off as the service's.
The sockets received are checked (listening TCP sockets on this address) before any is used.
What happens when nothing answers (the first load balancer of a service, one that predates
this, a crashed one): the new load balancer makes its sockets as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable

from fleetserve.lb.proxy import listen_addresses

log = logging.getLogger("fleetserve.lb")

TAKE_TIMEOUT = 2.0  # seconds a new load balancer waits for the old one's answer
# What one answer may carry: the kernel's SCM_MAX_FD (load_balancer.workers <= 64 processes,
# two address families each: 128 at most).
MAX_SOCKETS = 253
# The load balancer this one replaced holds the name until its stop begins: try again this
# often, so that one replacing this one soon after still finds it.
BIND_RETRY_SECONDS = 0.05
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def handover_name(service: str, host: str, port: int) -> bytes:
    """The abstract socket name of a service's load balancer on host:port, for this user."""
    digest = hashlib.sha256(f"{os.getuid()}\0{service}\0{host}\0{port}".encode()).hexdigest()
    return b"\0fleetserve-lb-" + digest[:40].encode()


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def wanted_addresses(host: str, port: int) -> set[tuple[int, tuple[str, int]]]:
    """(family, (address, port)) of each socket `listening_sockets(host, port)` makes."""
    return {(f, (str(a[0]), int(a[1]))) for f, _, a in listen_addresses(host, port)}


def _fits(sock: socket.socket, wanted: set[tuple[int, tuple[str, int]]]) -> bool:
    try:
        name = sock.getsockname()
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    if sock.type != socket.SOCK_STREAM or not listening or not isinstance(name, tuple):
        return False
    return (sock.family, (str(name[0]), int(name[1]))) in wanted


def _covers(group: list[socket.socket], wanted: set[tuple[int, tuple[str, int]]]) -> bool:
    """One listening socket on each wanted address, and nothing else."""
    if not all(_fits(s, wanted) for s in group):
        return False
    names = set()
    for s in group:
        name = s.getsockname()
        names.add((s.family, (str(name[0]), int(name[1]))))
    return names == wanted and len(group) == len(wanted)


def take(service: str, host: str, port: int) -> tuple[list[list[socket.socket]], int] | None:
    """The listening sockets of the load balancer of `service` on host:port that this one
    replaces, grouped as its processes held them, and its pid; None if none answers, if it
    is another user's, or if what it sent is not this address's listening sockets."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(TAKE_TIMEOUT)
    fds: list[int] = []
    try:
        with conn:
            conn.connect(handover_name(service, host, port))
            pid, uid = peer_credentials(conn)
            if uid != os.getuid():
                log.warning("handover: the process on the service's name is not ours: ignored")
                return None
            message, fds, _, _ = socket.recv_fds(conn, 65536, MAX_SOCKETS)
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        return None  # no load balancer before this one (or one that does not hand over)
    socks: list[socket.socket] = []
    pending = list(fds)  # not yet owned by a socket object
    try:
        while pending:
            socks.append(socket.socket(fileno=pending[0]))  # OSError: not a socket
            pending.pop(0)
        sizes = json.loads(message)["groups"]
        ok = (
            isinstance(sizes, list)
            and all(isinstance(n, int) and n > 0 for n in sizes)
            and sum(sizes) == len(socks)
        )
    except Exception:  # a malformed answer (not sockets, bad JSON, too deep): none is used
        ok = False
    for fd in pending:
        os.close(fd)
    groups: list[list[socket.socket]] = []
    if ok:
        at = 0
        for n in sizes:
            groups.append(socks[at : at + n])
            at += n
    wanted = wanted_addresses(host, port)
    # Every group (one process's sockets) must listen on each of the address's families.
    if not ok or not groups or not all(_covers(g, wanted) for g in groups):
        log.warning("handover: the sockets received are not this address's: made new ones")
        for s in socks:
            s.close()
        return None
    for s in socks:
        s.setblocking(False)
    return groups, pid


class HandoverServer:
    """Answers a load balancer that replaces this one with this one's listening sockets
    (`groups`, read at each request: one list per process). Binds the name as soon as it is
    free (the load balancer this one replaced holds it until it exits)."""

    def __init__(
        self, service: str, host: str, port: int, groups: Callable[[], list[list[socket.socket]]]
    ) -> None:
        self.name = handover_name(service, host, port)
        self.groups = groups
        self.listener: socket.socket | None = None
        self.handed = 0  # answers sent
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.listener is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.bind(self.name)
                sock.listen(8)
            except OSError:
                sock.close()
                await asyncio.sleep(BIND_RETRY_SECONDS)
                continue
            sock.setblocking(False)
            self.listener = sock
        loop.add_reader(self.listener.fileno(), self._accept)

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.warning("handover: accept failed: %s", e)
            return
        pid = 0
        with conn:
            try:
                pid, uid = peer_credentials(conn)
                if uid != os.getuid():
                    log.warning("handover: refused a process of uid %s (pid %s)", uid, pid)
                    return
                groups = [g for g in self.groups() if g]
                fds = [s.fileno() for g in groups for s in g]
                if any(fd < 0 for fd in fds):
                    return  # closing: nothing to hand over
                message = json.dumps({"groups": [len(g) for g in groups]}).encode()
                socket.send_fds(conn, [message], fds)
            except OSError as e:
                log.warning("handover: could not answer pid %s: %s", pid, e)
                return
        self.handed += 1
        log.info("handed its listening sockets to the load balancer replacing it (pid %s)", pid)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.listener is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self.listener.fileno())
            self.listener.close()
            self.listener = None


def arrange(
    taken: list[list[socket.socket]], count: int, make: Callable[[], list[socket.socket]]
) -> dict[int, list[socket.socket]]:
    """`count` processes' listening sockets from the groups taken over: group i is process
    i's; a process beyond them gets new ones (`make`); groups beyond the processes are
    every process's (each accepts from those queues too: the kernel keeps sending them a
    share of the connections, which no one process should take alone)."""
    listeners: dict[int, list[socket.socket]] = {}
    for i in range(count):
        listeners[i] = list(taken[i]) if i < len(taken) else make()
    for j in range(count, len(taken)):
        for i in range(count):
            listeners[i].extend(taken[j])
    return listeners
