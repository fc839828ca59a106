"""Who listens on a local TCP port: read from /proc/net/tcp{,6}, which every user may read.

Used wherever a secret is about to be sent to, or trust given to, "whatever answers on port
P of this machine": the token to the controller, the LB's wake-up call, a replica's probe.
"""

from __future__ import annotations

import os
import socket
import struct
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


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 64  # netlink header, then inet_diag_msg's family..wqueue before idiag_uid


def tcp_uid(src: str, sport: int, dst: str, dport: int) -> int | None:
    """The uid owning the local TCP socket src:sport -> dst:dport, asked of the kernel by
    sock_diag netlink (what `ss` uses; any user may ask, as any user may read
    /proc/net/tcp, but it costs ~50 µs where reading a busy /proc/net/tcp costs tens of ms);
    None if there is no such socket, or the kernel does not answer."""
    v4 = src.removeprefix("::ffff:")
    if "." in v4 and "." in dst.removeprefix("::ffff:"):
        family, src, dst = socket.AF_INET, v4, dst.removeprefix("::ffff:")
    else:
        family = socket.AF_INET6
    try:
        ids = [socket.inet_pton(family, a).ljust(16, b"\0") for a in (src, dst)]
    except OSError:
        return None
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
    req += struct.pack(">HH", sport, dport) + ids[0] + ids[1]
    req += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    head = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
            s.settimeout(1.0)
            s.sendto(head + req, (0, 0))
            data = s.recv(8192)
    except OSError:
        return None
    if len(data) < _UID_AT + 4 or struct.unpack_from("=H", data, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None
    return int(struct.unpack_from("=I", data, _UID_AT)[0])
