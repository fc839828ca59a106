"""A load balancer that replaces another takes over its listening sockets (the same queues),
and a stopping one answers what it accepted: no request is lost when the settings change."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path

import aiohttp
import psutil
import pytest

from fleetserve.lb import handover
from fleetserve.lb.config import LbConfig
from fleetserve.lb.handover import HandoverServer, arrange, handover_name, take
from fleetserve.lb.proxy import Proxy, listening_sockets
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.factory import make_selector
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import start_lb_process, wait_workers, workers_of
from tests.unit.lb.test_proxy import Start, closed_port, start, upstream_app
from tests.unit.lb.test_workers import _answers, _queue_requests, _ready

__all__ = ["start"]


def _lb(service: str, port: int, policy: str = "least_load", workers: int = 2) -> LbConfig:
    return LbConfig(
        service=service,
        port=port,
        admin_port=closed_port(),
        policy=policy,  # type: ignore[arg-type]
        options=LoadBalancerOptions(workers=workers),
    )


async def _push(config: LbConfig, url: str) -> None:
    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": url}]}
        async with s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=push) as r:
            assert r.status == 200
    await asyncio.sleep(0.3)  # relayed to the workers


def _stop(proc: subprocess.Popen[bytes], workers: list[psutil.Process]) -> None:
    proc.kill()
    proc.wait(10)
    for w in workers:
        w.kill()


async def test_a_replacing_load_balancer_serves_what_waits_in_the_old_ones_queues(
    start: Start, tmp_path: Path
) -> None:
    """Old and new load balancer of a service on one port: the new one listens on the old
    one's sockets. Connections queued on the old one's sockets when it goes (here: killed while
    stopped, so none of them is accepted by it) are answered by the new one. With sockets of
    its own (SO_REUSEPORT alone) the kernel resets every connection queued on the old one's."""
    url = f"http://127.0.0.1:{await start(upstream_app('a'))}"
    port = closed_port()
    old_config = _lb("svc", port)
    old = await start_lb_process(old_config, tmp_path / "old")
    old_workers = await wait_workers(old)
    new: subprocess.Popen[bytes] | None = None
    new_workers: list[psutil.Process] = []
    try:
        await _ready(old_config)
        await _push(old_config, url)
        new_config = _lb("svc", port, policy="round_robin", workers=3)  # new settings
        new = await start_lb_process(new_config, tmp_path / "new")
        await _ready(new_config)
        new_workers = workers_of(new)
        assert len(new_workers) == 2
        await _push(new_config, url)
        # The new one took the two sockets the old one had, and made one for its third worker.
        inodes = _socket_inodes(old.pid, port)
        taken = _socket_inodes(new.pid, port)
        assert len(inodes) == 2 and inodes < taken and len(taken) == 3
        for p in [old, *old_workers]:
            os.kill(p.pid, signal.SIGSTOP)  # the old one accepts nothing more
        try:
            socks = await asyncio.to_thread(_queue_requests, port, 30)
        finally:
            _stop(old, old_workers)
        answers = await asyncio.to_thread(_answers, socks)
        assert [x[:15] for x in answers] == [b"HTTP/1.1 200 OK"] * 30, answers
    finally:
        _stop(old, old_workers)
        if new is not None:
            new.send_signal(signal.SIGTERM)
            new.wait(10)
            _, alive = psutil.wait_procs(new_workers, timeout=10)
            assert not alive


def _socket_inodes(pid: int, port: int) -> set[int]:
    """The inodes of `pid`'s listening sockets on `port` (one socket, one inode)."""
    return {
        os.stat(f"/proc/{pid}/fd/{c.fd}").st_ino
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


async def test_take_gets_the_groups_and_refuses_what_is_not_this_address() -> None:
    port = closed_port()
    groups = [listening_sockets("127.0.0.1", port), listening_sockets("127.0.0.1", port)]
    server = HandoverServer("svc", "127.0.0.1", port, lambda: groups)
    server.start()
    try:
        for _ in range(50):
            if server.listener is not None:
                break
            await asyncio.sleep(0.02)
        got = await asyncio.to_thread(take, "svc", "127.0.0.1", port)
        assert got is not None
        taken, pid = got
        assert pid == os.getpid() and server.handed == 1
        assert [len(g) for g in taken] == [1, 1]
        assert [s.getsockname() for g in taken for s in g] == [("127.0.0.1", port)] * 2
        for g in taken:
            for s in g:
                s.close()
        # Another service, or the same one on another address, finds nothing.
        assert await asyncio.to_thread(take, "other", "127.0.0.1", port) is None
        assert await asyncio.to_thread(take, "svc", "127.0.0.1", closed_port()) is None
    finally:
        server.close()
        for g in groups:
            for s in g:
                s.close()
    assert await asyncio.to_thread(take, "svc", "127.0.0.1", port) is None  # closed


async def test_sockets_of_another_address_are_refused_and_closed() -> None:
    """A process answering on the name with sockets that are not the address's (another port,
    a socket that does not listen) gets nothing used: take makes none its own."""
    port, elsewhere = closed_port(), closed_port()
    wrong = listening_sockets("127.0.0.1", elsewhere)
    unbound = [socket.socket()]
    for bad in (wrong, unbound):
        server = HandoverServer("svc", "127.0.0.1", port, lambda bad=bad: [bad])  # type: ignore[misc]
        server.start()
        try:
            await asyncio.sleep(0.1)
            before = len(os.listdir("/proc/self/fd"))
            assert await asyncio.to_thread(take, "svc", "127.0.0.1", port) is None
            assert len(os.listdir("/proc/self/fd")) == before  # what came was closed
        finally:
            server.close()
    for s in (*wrong, *unbound):
        s.close()


async def test_a_process_of_another_user_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server reads its peer's uid (SO_PEERCRED): one that is not its own user's gets no
    socket. (The peer here is this process; the server is told its own uid is another.)"""
    port = closed_port()
    name = handover_name("svc", "127.0.0.1", port)
    groups = [listening_sockets("127.0.0.1", port)]
    server = HandoverServer("svc", "127.0.0.1", port, lambda: groups)
    server.start()
    await asyncio.sleep(0.1)
    real = os.getuid()
    try:
        monkeypatch.setattr(handover.os, "getuid", lambda: real + 1)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(2)
        with conn:
            conn.connect(name)
            await asyncio.sleep(0.1)  # the server accepts, reads the uid and hangs up
            message, fds, _, _ = await asyncio.to_thread(socket.recv_fds, conn, 4096, 8)
        assert (message, fds) == (b"", [])
        assert server.handed == 0
    finally:
        monkeypatch.undo()
        server.close()
        groups[0][0].close()


def test_arrange_spreads_the_groups_over_the_processes() -> None:
    made: list[str] = []

    def make() -> list[socket.socket]:
        made.append("new")
        return [socket.socket()]

    a, b, c = ([socket.socket()] for _ in range(3))
    try:
        assert arrange([a, b, c], 2, make) == {0: [*a, *c], 1: b}  # a process serves two
        assert made == []
        three = arrange([a], 3, make)
        assert three[0] == a and len(made) == 2 and three[1] != three[2]
        for extra in (three[1], three[2]):
            extra[0].close()
        assert arrange([], 1, make)[0] != a and len(made) == 3
    finally:
        for s in (*a, *b, *c):
            s.close()


async def test_a_stopping_proxy_reads_a_request_sent_just_after_the_stop(start: Start) -> None:
    """A connection accepted before the stop whose request comes a moment later is answered
    (closing it unread would fail a request its client had sent); a connection idle between
    requests is closed at once; one answered during the stop is closed after its answer."""
    a = await start(upstream_app("a"))
    replicas = ReplicaSet(make_selector("least_load"))
    replicas.replace([Upstream(1, f"http://127.0.0.1:{a}", 1)])
    proxy = Proxy(LbConfig(service="svc", port=0, admin_port=0), replicas)
    await proxy.serve("127.0.0.1", 0)
    port = proxy.port
    request = b"GET /late HTTP/1.1\r\nHost: lb\r\n\r\n"
    late_r, late_w = await asyncio.open_connection("127.0.0.1", port)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    idle_w.write(request)
    head = await idle_r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await idle_r.readexactly(length)  # answered and kept alive: idle between requests
    await asyncio.sleep(0.1)  # both accepted
    closing = asyncio.create_task(proxy.close())
    assert await asyncio.wait_for(idle_r.read(), 0.5) == b""  # the idle one: closed at once
    await asyncio.sleep(0.3)
    late_w.write(request)
    answer = await asyncio.wait_for(late_r.read(), 5)  # answered, then closed
    assert answer.startswith(b"HTTP/1.1 200 OK") and b'"replica": "a"' in answer
    await asyncio.wait_for(closing, 5)
    for w in (late_w, idle_w):
        w.close()
