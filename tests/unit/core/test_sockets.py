"""Whose is a local TCP socket (fleetserve.core.sockets.tcp_uid, sock_diag netlink): real
sockets, one of them another user's when the tests run as root."""

from __future__ import annotations

import os
import socket
import subprocess
import time

from fleetserve.core.sockets import tcp_uid


def test_the_uid_of_a_connected_socket_both_ways_and_none_for_a_missing_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, peer = server.accept()
            with accepted:
                assert tcp_uid(peer[0], peer[1], "127.0.0.1", port) == os.getuid()
                # As a dual-stack server sees an IPv4 client.
                assert tcp_uid(f"::ffff:{peer[0]}", peer[1], "::ffff:127.0.0.1", port) == (
                    os.getuid()
                )
                assert tcp_uid("127.0.0.1", 1, "127.0.0.1", port) is None
                assert tcp_uid("not an address", peer[1], "127.0.0.1", port) is None
                client.close()


def test_the_uid_of_another_users_socket() -> None:
    """As root, a socket of `nobody` (65534); otherwise this user's own, over IPv6."""
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as server:
        port = server.getsockname()[1]
        connect = f"socket.create_connection(('::1', {port}))"
        script = f"import socket, time; s = {connect}; time.sleep(5)"
        as_root = os.geteuid() == 0
        proc = subprocess.Popen(
            ["/usr/bin/python3", "-c", script], user="nobody" if as_root else None, cwd="/"
        )
        try:
            server.settimeout(10)
            accepted, peer = server.accept()
            with accepted:
                deadline = time.monotonic() + 5
                uid = None
                while uid is None and time.monotonic() < deadline:
                    uid = tcp_uid(peer[0], peer[1], "::1", port)
                assert uid == (65534 if as_root else os.getuid())
        finally:
            proc.kill()
            proc.wait()
