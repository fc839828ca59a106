"""A replica in network namespace of its own without root: an unprivileged user namespace.

The fixed-port shape (`ports: 8080`, several replicas) needs each replica to have a port 8080 of
its own. As root, fleetserve.infra.netns gives each a named namespace and a veth pair. As a
normal user that is not allowed, but a user namespace is (where the kernel permits them): the
replica runs in a new user + network namespace, where its user is mapped to itself (no
privilege is gained: the namespace's root is nobody outside it).

Such a namespace has only a loopback device, so it is joined to this machine by a relay, not a
route: the controller binds a listening socket on this machine's 127.0.0.1 (a free port, the
address the load balancer and the prober use) and hands it to this program; the program makes
the namespace and, inside it, accepts on that socket (it still belongs to this machine's
network) and connects each accepted connection to 127.0.0.1:<fixed port> inside the namespace.
Outbound traffic (downloading weights, `pip install` in setup) goes through slirp4netns when it
is installed (Debian's `slirp4netns`), started outside the namespace; without it the replica
has loopback only, and its log says so.

Run as `python -m fleetserve.infra.userns --listen-fd FD --port PORT -- COMMAND...`; three
processes result, all with the replica's environment (and so its launch token):
  outer   (this machine's network) starts slirp4netns, then waits for `inner`, exits with its code
  inner   (the new namespaces) the relay; exits with the replica's code when the replica ends
  replica COMMAND, started by inner
`--probe` exits 0 when a user + network namespace can be made here (what
fleetserve.oshelpers.netcaps.userns_available asks). This module imports nothing of
fleetserve: it runs on its own (tests/e2e/test_userns_fleet.py runs a copy as `nobody`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import functools
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, cast

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then the flags of its union (40 bytes on Linux)
_CONNECT_TIMEOUT = 5.0


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def enter_namespaces() -> None:
    """Make this (single-threaded) process's user and network namespaces new ones, with its
    user and group mapped to themselves and loopback up."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    # The namespace's capabilities last until exec: enough to bring loopback up.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def outbound_tool() -> str | None:
    return shutil.which("slirp4netns")


# -- the relay (inside the namespace) ----------------------------------------------------------


class _Side(asyncio.Protocol):
    """One end of a relayed connection: what it receives is written to the other end, with
    flow control (a slow reader pauses the fast writer) and half-closes passed on."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # received before the peer was connected
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def link(self, peer: _Side) -> None:
        self.peer = peer
        assert peer.transport is not None
        for data in self.pending:
            peer.transport.write(data)
        self.pending.clear()
        if self.eof:
            self._pass_eof()
        elif self.transport is not None:
            self.transport.resume_reading()  # paused while there was no peer

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.pending.append(data)
            if self.transport is not None:
                self.transport.pause_reading()  # until linked
            return
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self.peer is not None:
            self._pass_eof()
        return True  # keep the other direction open

    def _pass_eof(self) -> None:
        assert self.peer is not None and self.peer.transport is not None
        if self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        if self.peer.eof:
            self._close_both()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_both()

    def _close_both(self) -> None:
        for side in (self, self.peer):
            if side is not None and side.transport is not None and not side.transport.is_closing():
                side.transport.close()


class _Client(_Side):
    """A connection accepted on this machine's socket: connects to the replica for it."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        upstream = await _dial(self.port)
        if upstream is None:
            _say_not_listening(self.port)
            if self.transport is not None:  # the replica does not listen (yet): a reset
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()
            return
        if self.transport is None or self.transport.is_closing():
            if upstream.transport is not None:
                upstream.transport.close()
            return
        upstream.link(self)
        self.link(upstream)


async def _dial(port: int) -> _Side | None:
    """A connection to the replica inside the namespace: IPv4 loopback, else IPv6's."""
    loop = asyncio.get_running_loop()
    for host in ("127.0.0.1", "::1"):
        try:
            _, side = await asyncio.wait_for(
                loop.create_connection(_Side, host, port), _CONNECT_TIMEOUT
            )
            return side
        except (OSError, TimeoutError):
            continue
    return None


_said_at = [0.0]  # when the replica's log last heard that nothing listens


def _say_not_listening(port: int, every: float = 60.0) -> None:
    """Once a minute at most, in the replica's log: why the load balancer and the probe see
    their connections reset (the relay accepted them for a replica that does not listen)."""
    now = time.monotonic()
    if now - _said_at[0] >= every:
        _said_at[0] = now
        print(
            f"[fleetserve] relay: nothing accepts connections on port {port} (127.0.0.1 or ::1) "
            "inside the replica's network namespace; connections to it are reset",
            flush=True,
        )


async def _relay(listen: socket.socket, port: int, replica: int) -> int:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(functools.partial(_Client, port), sock=listen, backlog=1024)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, functools.partial(_forward, replica, sig))
    # A thread waits for the replica (uvloop keeps SIGCHLD for itself).
    _, status = await loop.run_in_executor(None, os.waitpid, replica, 0)
    code = os.waitstatus_to_exitcode(status)
    server.close()
    return code


def _forward(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _inner(listen_fd: int, port: int, command: list[str], ready: int, go: int) -> int:
    """In the new namespaces: start the replica, relay to it until it ends."""
    os.write(ready, b"1")
    os.close(ready)
    os.read(go, 1)  # outer has started the outbound link (or decided there is none)
    os.close(go)
    replica = os.fork()
    if replica == 0:
        os.close(listen_fd)  # the replica must not hold the machine-side socket
        try:
            os.execvp(command[0], command)
        except OSError as e:
            print(f"[fleetserve] cannot run {command[0]}: {e}", flush=True)
        os._exit(127)
    listen = socket.socket(fileno=listen_fd)
    listen.setblocking(False)
    try:  # the load balancer's event loop where installed (this file also runs alone)
        import uvloop
    except ImportError:
        return asyncio.run(_relay(listen, port, replica))
    return uvloop.run(_relay(listen, port, replica))


def _outer(listen_fd: int, port: int, command: list[str]) -> int:
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            enter_namespaces()
        except OSError as e:
            print(f"[fleetserve] cannot make the replica's network namespace: {e}", flush=True)
            os._exit(70)
        _exit_as(_inner(listen_fd, port, command, ready_w, go_r))
    os.close(ready_w)
    os.close(go_r)
    os.close(listen_fd)
    if os.read(ready_r, 1) != b"1":
        _, status = os.waitpid(child, 0)
        return os.waitstatus_to_exitcode(status)
    os.close(ready_r)
    link = _start_outbound(child)
    os.write(go_w, b"1")
    os.close(go_w)
    signal.signal(signal.SIGTERM, lambda *_: _forward(child, signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: _forward(child, signal.SIGINT))
    while True:
        pid, status = os.wait()  # the replica's side ending, or the outbound link dying
        if pid == child:
            break
        if link is not None and pid == link.pid:
            code = os.waitstatus_to_exitcode(status)
            print(
                f"[fleetserve] replica network: slirp4netns ended ({_ended(code)}): no outbound "
                "traffic from now on; inbound traffic still reaches the replica",
                flush=True,
            )
            link = None
    if link is not None:
        link.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            link.wait(timeout=5)
    return os.waitstatus_to_exitcode(status)


def _ended(code: int) -> str:
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def start_slirp(target: list[str], **popen: Any) -> subprocess.Popen[bytes] | None:
    """slirp4netns for a namespace (`target`: a pid, or `--netns-type=path PATH`, then the
    device): user-space NAT out of it, a default route, this machine's loopback out of reach.
    Returns it once it says it is ready; None when it is not installed or did not start."""
    tool = outbound_tool()
    if tool is None:
        return None
    ready_r, ready_w = os.pipe()
    flags = ["--configure", "--mtu=65520", "--disable-host-loopback", f"--ready-fd={ready_w}"]
    try:
        link = subprocess.Popen(
            [tool, *flags, *target], pass_fds=(ready_w,), stdin=subprocess.DEVNULL, **popen
        )
    finally:
        os.close(ready_w)
    with os.fdopen(ready_r, "rb") as f:
        ok = f.read(1) == b"1"
    if not ok:
        link.wait()
        return None
    return link


def _start_outbound(pid: int) -> subprocess.Popen[bytes] | None:
    if outbound_tool() is None:
        print(
            "[fleetserve] replica network: a namespace of its own with loopback only (no "
            "outbound traffic: install slirp4netns for it)",
            flush=True,
        )
        return None
    # Its errors (e.g. no access to /dev/net/tun) go to the replica's log, this one's stderr.
    link = start_slirp([str(pid), "tap0"], stdout=subprocess.DEVNULL)
    if link is None:
        print(
            "[fleetserve] replica network: slirp4netns did not start (above: why), so a "
            "namespace of its own with loopback only (no outbound traffic)",
            flush=True,
        )
        return None
    print("[fleetserve] replica network: a namespace of its own, outbound through slirp4netns")
    sys.stdout.flush()
    return link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetserve.infra.userns")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--listen-fd", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    if args.probe:
        pid = os.fork()
        if pid == 0:
            try:
                enter_namespaces()
            except OSError:
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    if args.listen_fd is None or args.port is None or not args.command:
        parser.error("--listen-fd, --port and a command are needed")
    return _outer(args.listen_fd, args.port, args.command)


def _exit_as(code: int) -> None:
    """Exit as the replica did: with its code, or killed by the same signal."""
    if code < 0:
        sys.stdout.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code & 0xFF)


if __name__ == "__main__":
    _exit_as(main())
