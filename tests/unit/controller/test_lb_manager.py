"""`LbManager` without an LB process: its port check against real loopback listeners, and its
admin calls (push, load) against a mock transport."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from fleetserve.controller import lb_manager
from fleetserve.controller.lb_manager import LB_SERVICE_ENV, LbManager
from fleetserve.controller.settings import Settings
from fleetserve.core.errors import TerminalError
from fleetserve.core.types import Endpoint, ServicePhase, ServiceRecord
from fleetserve.lb.messages import LoadReport
from fleetserve.oshelpers.ports import free_port
from fleetserve.oshelpers.procs import HOME_ID_ENV, started

HOME_ID = "h0me1d"


def service(name: str, admin_port: int, secret: str | None) -> ServiceRecord:
    return ServiceRecord(
        name=name,
        phase=ServicePhase.ACTIVE,
        active_version=1,
        created_at=0.0,
        updated_at=0.0,
        lb_port=30_000 + admin_port % 1000,
        lb_admin_port=admin_port,
        lb_pid=1234,
        lb_create_time=1.0,
        lb_secret=secret,
    )


A = service("a", 41_001, "secret-of-a")
B = service("b", 41_002, "secret-of-b")
E1 = [Endpoint(1, "http://a-1.test:8000", 1)]
E2 = [Endpoint(1, "http://a-1.test:8000", 1), Endpoint(2, "http://a-2.test:8000", 1)]


class AdminApi:
    """The LBs' admin APIs: records each request; answers `status`."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.status = 200

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/-/load":
            return httpx.Response(self.status, json={"total_requests": 7, "replicas": {}})
        return httpx.Response(self.status, json={"ok": True})

    def to(self, port: int) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.port == port]


@pytest.fixture
def api() -> AdminApi:
    return AdminApi()


@pytest.fixture
async def lb(tmp_path: Path, api: AdminApi) -> AsyncIterator[LbManager]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(api)) as client:
        yield LbManager(Settings(home=tmp_path, lb_repush_interval=10.0), client, HOME_ID)


@pytest.fixture
def listener() -> Iterator[int]:
    """A port held by a plain listening socket of this (test) process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# -- check_port -------------------------------------------------------------------------------


def test_check_port_accepts_a_free_port(lb: LbManager) -> None:
    lb.check_port("a", free_port())


def test_check_port_refuses_a_port_held_by_another_program(lb: LbManager, listener: int) -> None:
    with pytest.raises(TerminalError, match=f"port {listener} is in use by another program"):
        lb.check_port("a", listener)


def test_check_port_accepts_only_the_services_own_lb_workers(
    lb: LbManager, listener: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Present this process as a lingering LB worker of service "a" of this home.
    real = psutil.Process.environ

    def environ(p: psutil.Process) -> dict[str, str]:
        if p.pid == os.getpid():
            return {LB_SERVICE_ENV: "a", HOME_ID_ENV: HOME_ID}
        return real(p)

    monkeypatch.setattr(psutil.Process, "environ", environ)
    lb.check_port("a", listener)
    with pytest.raises(TerminalError):
        lb.check_port("b", listener)  # another service never shares the port
    other_home = LbManager(lb.settings, lb.client, home_id="another-home")
    with pytest.raises(TerminalError):
        other_home.check_port("a", listener)  # nor the same name in another home


# -- admin calls ------------------------------------------------------------------------------


async def test_push_and_load_carry_the_services_admin_secret(lb: LbManager, api: AdminApi) -> None:
    assert await lb.push(A, E1, now=100.0) is True
    assert await lb.load(A) == LoadReport(total_requests=7)
    put, get = api.requests
    assert (put.method, str(put.url)) == ("PUT", "http://127.0.0.1:41001/-/replicas")
    assert (get.method, str(get.url)) == ("GET", "http://127.0.0.1:41001/-/load")
    for r in (put, get):
        assert r.headers["Authorization"] == "Bearer secret-of-a"
    assert json.loads(put.content) == {
        "replicas": [{"replica_id": 1, "url": "http://a-1.test:8000", "version": 1, "weight": 1.0}]
    }


async def test_push_state_is_kept_per_service(lb: LbManager, api: AdminApi) -> None:
    await lb.push(A, E1, now=100.0)
    await lb.push(B, E1, now=100.0)  # same set, other service: sent all the same
    await lb.push(A, E1, now=101.0)  # unchanged and not due: not sent
    await lb.push(B, E2, now=101.0)  # changed
    await lb.push(A, E1, now=105.0, force=True)
    await lb.push(A, E1, now=115.0)  # due again (lb_repush_interval)
    assert len(api.to(41_001)) == 3
    assert [json.loads(r.content)["replicas"][-1]["replica_id"] for r in api.to(41_002)] == [1, 2]
    assert {r.headers["Authorization"] for r in api.to(41_002)} == {"Bearer secret-of-b"}


async def test_a_failed_push_is_sent_again_next_round(lb: LbManager, api: AdminApi) -> None:
    api.status = 500
    assert await lb.push(A, E1, now=100.0) is False
    assert await lb.load(A) is None
    api.status = 200
    assert await lb.push(A, E1, now=100.5) is True
    assert await lb.push(A, E1, now=101.0) is True
    assert len([r for r in api.to(41_001) if r.method == "PUT"]) == 2


# -- retire -----------------------------------------------------------------------------------


def _session_leader(script: str) -> subprocess.Popen[bytes]:
    """A process in a session (and process group) of its own, as LbManager.start makes."""
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True)


async def test_a_retired_lb_gets_sigquit_and_counts_as_retiring_until_it_exits(
    lb: LbManager,
) -> None:
    proc = _session_leader(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGQUIT, lambda *a: (time.sleep(1), sys.exit(0)))\n"
        "time.sleep(60)\n"
    )
    try:
        await asyncio.sleep(0.5)  # its handler installed
        lb.retire("web", proc.pid, started(psutil.Process(proc.pid)), drain_seconds=30)
        assert lb.retiring("web") and not lb.retiring("other")
        await asyncio.to_thread(proc.wait, 10)
        assert proc.returncode == 0  # it went by itself (its SIGQUIT handler), not killed
        assert not lb.retiring("web")
    finally:
        proc.kill()
        proc.wait()


async def test_a_retired_lb_that_outlives_its_drain_is_killed_with_its_workers(
    lb: LbManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lb_manager, "RETIRE_MARGIN_SECONDS", 0.5)
    # A "primary" that ignores SIGQUIT, with a "worker" in its process group.
    proc = _session_leader(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGQUIT, signal.SIG_IGN)\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    worker = None
    try:
        await asyncio.sleep(1.0)
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1
        worker = children[0]
        lb.retire("web", proc.pid, started(psutil.Process(proc.pid)), drain_seconds=0.5)
        await asyncio.to_thread(proc.wait, 10)
        assert proc.returncode == -signal.SIGKILL
        assert psutil.wait_procs([worker], timeout=5)[1] == []  # the group went
        await asyncio.sleep(0.1)
        assert not lb.retiring("web")
    finally:
        proc.kill()
        proc.wait()
        if worker is not None and worker.is_running():
            worker.kill()


async def test_down_kills_a_retiring_lb(lb: LbManager) -> None:
    proc = _session_leader(
        "import signal, time\nsignal.signal(signal.SIGQUIT, signal.SIG_IGN)\ntime.sleep(60)\n"
    )
    try:
        await asyncio.sleep(0.5)
        lb.retire("web", proc.pid, started(psutil.Process(proc.pid)), drain_seconds=300)
        await lb.stop("web", None, None)
        await asyncio.to_thread(proc.wait, 5)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
