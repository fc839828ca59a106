"""Slow clients for tests (slowloris and its kin), as a script: `python3 slow_clients.py
HOST PORT MODE COUNT SECONDS [SOURCE]` holds COUNT connections to HOST:PORT for SECONDS (or
until SIGTERM), each doing MODE, and opens a new one whenever one is closed; then prints one
JSON line: how many it opened, how many the server closed, and the most it held at once.

Modes: `head` sends a request line, then one header line every 0.3 s (never the blank line);
`silent` sends nothing (over TLS: a handshake that never starts); `hello` sends the first
half of a TLS ClientHello; `idle` sends `GET /api/v1/health` on a keep-alive connection, reads
the answer, then sends the next one just before the keep-alive timeout (every 20 s); `body`
sends a POST head with `Content-Length: 100000`, then one byte of body every 0.3 s.

Standard library only (it runs as another user, with the system's python3), bounded in count
and time, loopback only.
"""

from __future__ import annotations

import errno
import json
import selectors
import signal
import socket
import sys
import time

TICK = 0.3
HELLO_HALF = bytes.fromhex("160301020001000200")  # a ClientHello record, cut short


def main() -> None:
    host, port, mode, count, seconds = (
        sys.argv[1],
        int(sys.argv[2]),
        sys.argv[3],
        int(sys.argv[4]),
        float(sys.argv[5]),
    )
    source = sys.argv[6] if len(sys.argv) > 6 else None
    assert host.startswith("127.") and count <= 2000 and seconds <= 120
    sel = selectors.DefaultSelector()
    socks: dict[socket.socket, float] = {}  # -> when it last sent
    opened = closed = most = 0
    end = time.monotonic() + seconds

    def stop(*_: object) -> None:
        nonlocal end
        end = 0.0

    signal.signal(signal.SIGTERM, stop)

    def first_bytes() -> bytes:
        if mode == "head":
            return b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if mode == "hello":
            return HELLO_HALF
        if mode == "idle":
            return b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        if mode == "body":
            return (
                b"POST /api/v1/services HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
        return b""

    def open_one() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        if source:
            s.bind((source, 0))
        err = s.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            s.close()
            time.sleep(0.01)
            return
        opened += 1
        socks[s] = 0.0
        sel.register(s, selectors.EVENT_READ)

    def drop(s: socket.socket) -> None:
        nonlocal closed
        closed += 1
        sel.unregister(s)
        socks.pop(s, None)
        s.close()

    while time.monotonic() < end:
        while len(socks) < count and time.monotonic() < end:
            open_one()
        most = max(most, len(socks))
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                drop(s)
        now = time.monotonic()
        for s, last in list(socks.items()):
            every = 20.0 if mode == "idle" else TICK
            if now - last < every:
                continue
            out = first_bytes() if last == 0.0 else b""
            if last != 0.0:
                out = {"head": b"X-Slow: 1\r\n", "body": b"x", "idle": first_bytes()}.get(mode, b"")
            socks[s] = now
            if not out:
                continue
            try:
                s.send(out)
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno == errno.ENOTCONN:  # still connecting: again at the next tick
                    socks[s] = last
                    continue
                drop(s)
    for s in list(socks):
        s.close()
    print(json.dumps({"opened": opened, "closed": closed, "most": most}), flush=True)


if __name__ == "__main__":
    main()
