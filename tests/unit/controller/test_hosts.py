"""High availability across hosts (docs/scaling.md): a controller never adopts, probes by
pid or stops a process recorded on another host. Local replicas of another host are lost and
replaced here; a load balancer of another host is left alone and this controller starts its
own; processes of this host whose records name another host are stale, and stopped by the
active controller's sweep. On the fake infra and LB (their `host`), a fake clock, a store on
SQLite."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import psutil
import pytest

from fleetserve.controller.controller import Controller
from fleetserve.controller.lb_manager import LB_SERVICE_ENV, LbManager
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import ServiceReconciler
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ServicePhase, ServiceRecord, TerminationCause
from fleetserve.infra.host import HOST_ID_ENV
from fleetserve.oshelpers.procs import HOME_ID_ENV, started
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, service_yaml, settle

ROUND = 0.25


class Host:
    """One controller's view: its infra and LB manager on `name`, sharing the replicas'
    instances (so that a probe by handle would find them running: it must not be asked)."""

    def __init__(self, name: str, first_pid: int, shared: FakeInfra | None = None) -> None:
        self.infra = FakeInfra(host=name)
        if shared is not None:
            self.infra.states = shared.states
        self.lb = FakeLb(first_pid=first_pid, host=name)


def reconciler(
    store: Store,
    clock: FakeClock,
    host: Host,
    client: httpx.AsyncClient,
    settings: Settings,
) -> ServiceReconciler:
    lb = cast(LbManager, host.lb)
    return ServiceReconciler("web", store, host.infra, lb, Prober(client), settings, clock)


def ok(_request: httpx.Request) -> httpx.Response:
    return httpx.Response(200)


async def rounds(clock: FakeClock, rec: ServiceReconciler, n: int) -> None:
    for _ in range(n):
        clock.advance(ROUND)
        await rec.reconcile_once()
        await settle()


async def start_on_a(
    store: Store, clock: FakeClock, settings: Settings, client: httpx.AsyncClient
) -> Host:
    a = Host("host-a", 50_000)
    create_service(store, "web", service_yaml(replicas=2), clock.now())
    rec = reconciler(store, clock, a, client, settings)
    await rounds(clock, rec, 6)
    assert [r.status for r in store.list_replicas("web")] == [ReplicaStatus.READY] * 2
    return a


async def test_a_takeover_on_another_host_replaces_its_local_replicas_and_starts_its_own_lb(
    store: Store, clock: FakeClock, settings: Settings
) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        a = await start_on_a(store, clock, settings, client)
        assert {r.host for r in store.list_replicas("web")} == {"host-a"}  # launches record it
        svc = store.service("web")
        assert svc.lb_host == "host-a" and svc.lb_pid == a.lb.pids["web"]

        stopping: list[tuple[int, TerminationCause | None]] = []
        store.replica_listeners.append(
            lambda _old, r: (
                stopping.append((r.replica_id, r.termination_cause))
                if r.status is ReplicaStatus.SHUTTING_DOWN
                else None
            )
        )
        b = Host("host-b", 60_000, shared=a.infra)
        rec = reconciler(store, clock, b, client, settings)
        await rec.recover()
        events = [e.message for e in store.list_events("web", 200)]
        assert not any("adopted" in m for m in events)  # another host's: never adopted
        await rounds(clock, rec, 8)

    rows = store.list_replicas("web")
    # Lost and replaced here: their rows gone, two new replicas on host-b.
    assert [(r.replica_id, r.status, r.host) for r in rows] == [
        (3, ReplicaStatus.READY, "host-b"),
        (4, ReplicaStatus.READY, "host-b"),
    ]
    assert b.infra.terminated == []  # nothing of host-a's stopped from host-b
    # Lost with their host, not preempted nor failed: a cause whose row goes.
    assert stopping == [(1, TerminationCause.HOST_LOST), (2, TerminationCause.HOST_LOST)]
    assert [lr.launch_token for lr in b.infra.launches] == [r.launch_token for r in rows]
    events = [e.message for e in store.list_events("web", 200)]
    lost = [m for m in events if "it ran on host host-a" in m]
    assert len(lost) == 4, events  # terminating (1, 2), then removed (1, 2), saying why
    assert "whose controller is gone" in lost[0] and "host-b" in lost[0]
    # Its own LB, on the service's port; host-a's is neither probed nor stopped.
    svc2 = store.service("web")
    assert [c.port for c in b.lb.started] == [svc.lb_port]
    assert (svc2.lb_port, svc2.lb_host, svc2.lb_pid) == (svc.lb_port, "host-b", b.lb.pids["web"])
    assert b.lb.stopped == []
    assert any("recorded on host host-a; this controller runs on host-b" in m for m in events)
    # The same host again (a restart on host-b): adopted, as always.
    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        again = Host("host-b", 70_000, shared=b.infra)
        again.lb.pids = dict(b.lb.pids)
        rec = reconciler(store, clock, again, client, settings)
        await rec.recover()
        await rounds(clock, rec, 3)
    assert [r.replica_id for r in store.list_replicas("web")] == [3, 4]
    adopted = [e for e in store.list_events("web", 300) if "adopted" in e.message]
    assert [e.replica_id for e in adopted] == [3, 4]
    assert again.lb.started == []


async def test_launches_and_teardowns_cut_short_on_another_host_are_not_acted_on_here(
    store: Store, clock: FakeClock, settings: Settings
) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        await start_on_a(store, clock, settings, client)
        one, two = store.list_replicas("web")
        cut = store.update_replica(one, clock.now(), status=ReplicaStatus.PROVISIONING)
        store.update_replica(
            two, clock.now(), status=ReplicaStatus.SHUTTING_DOWN, reason="scaled down"
        )
        b = Host("host-b", 60_000)
        rec = reconciler(store, clock, b, client, settings)
        await rec.recover()
        await settle()
        relaunch = store.replica("web", 1)
        assert (relaunch.status, relaunch.handle, relaunch.host) == (
            ReplicaStatus.PENDING,
            None,
            None,
        )
        assert relaunch.launch_token != cut.launch_token
        assert store.replica("web", 2).status is ReplicaStatus.FAILED  # its teardown recorded
        assert b.infra.terminated == []  # neither was stopped from here
        events = [e.message for e in store.list_events("web", 200)]
        assert "launch interrupted on host host-a, whose controller is gone: relaunching on " in (
            " ".join(events)
        )
        await rounds(clock, rec, 6)
    assert store.replica("web", 1).host == "host-b"
    assert store.replica("web", 1).status is ReplicaStatus.READY


async def test_a_recorded_port_taken_on_this_host_moves_the_endpoint(
    store: Store, clock: FakeClock, settings: Settings
) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        await start_on_a(store, clock, settings, client)
        port = store.service("web").lb_port
        assert port is not None
        with socket.socket() as held:  # another program holds it on host-b
            held.bind(("127.0.0.1", port))
            held.listen()
            b = Host("host-b", 60_000)
            rec = reconciler(store, clock, b, client, settings)
            await rec.reconcile_once()
    svc = store.service("web")
    assert svc.lb_port is not None and svc.lb_port != port and svc.lb_host == "host-b"
    assert [c.port for c in b.lb.started] == [svc.lb_port]
    events = [e.message for e in store.list_events("web", 200)]
    assert f"load balancer port {port} is taken on this host: choosing another" in events


async def test_down_on_another_host_never_stops_the_first_hosts_lb(
    store: Store, clock: FakeClock, settings: Settings
) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        a = await start_on_a(store, clock, settings, client)
        store.update_service("web", clock.now(), phase=ServicePhase.SHUTTING_DOWN)
        b = Host("host-b", 60_000, shared=a.infra)
        rec = reconciler(store, clock, b, client, settings)
        await rec.recover()
        assert await rec.reconcile_once() is True
    assert b.lb.stopped == [("web", None)]  # its config here, no process of host-a
    assert b.infra.terminated == [] and store.get_service("web") is None


# -- LbManager and the takeover's sweep on real processes -------------------------------------


def lb_record(name: str, pid: int, create_time: float, host: str | None) -> ServiceRecord:
    return ServiceRecord(
        name=name,
        phase=ServicePhase.ACTIVE,
        active_version=1,
        created_at=0.0,
        updated_at=0.0,
        lb_port=30_123,
        lb_admin_port=41_123,
        lb_pid=pid,
        lb_create_time=create_time,
        lb_host=host,
    )


@pytest.fixture
def fake_lb_process() -> Iterator[psutil.Process]:
    """A process that looks like an LB of home "h0me" for service "web" (its environment)."""
    env = dict(os.environ, **{LB_SERVICE_ENV: "web", HOME_ID_ENV: "h0me"})
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


async def test_an_lb_recorded_on_another_host_is_not_probed_and_ours_here_is_stale(
    tmp_path: Path, fake_lb_process: psutil.Process
) -> None:
    p = fake_lb_process
    me = started(p)
    async with httpx.AsyncClient() as client:
        lb = LbManager(Settings(home=tmp_path), client, "h0me", host="host-b")
        # Its own host's record: the process is running, and the sweep keeps it.
        assert lb.is_running(lb_record("web", p.pid, me, "host-b"))
        assert lb.is_running(lb_record("web", p.pid, me, None))  # recorded before hosts
        assert await lb.sweep([lb_record("web", p.pid, me, "host-b")]) == 0
        # The same pid recorded on another host means nothing here: not running (not probed).
        lb2 = LbManager(Settings(home=tmp_path), client, "h0me", host="host-b")
        assert not lb2.is_running(lb_record("web", p.pid, me, "host-a"))
        # ... and this host's LB of that service is stale: the active controller stops it.
        assert await lb2.sweep([lb_record("web", p.pid, me, "host-a")]) == 1
    await asyncio.to_thread(p.wait, 10)
    assert not p.is_running()


class SweepRecorder(FakeInfra):
    def __init__(self, host: str) -> None:
        super().__init__(host=host)
        self.swept: list[set[str]] = []

    async def sweep(self, known_tokens: set[str]) -> int:
        self.swept.append(set(known_tokens))
        return 0


async def test_the_takeover_sweep_treats_tokens_recorded_on_another_host_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "host-b")
    settings = Settings(home=tmp_path / "home")
    settings.home.mkdir(mode=0o700)
    infra = SweepRecorder("host-b")
    ctl = Controller(settings, infra=infra)
    try:
        assert ctl.host == "host-b"
        store = ctl.store
        create_service(store, "web", service_yaml(replicas=3), 1.0)
        mine = store.allocate_replica("web", 1, "fake", "tok-b", 2.0)
        store.update_replica(mine, 2.0, host="host-b")
        old = store.allocate_replica("web", 1, "fake", "tok-old", 2.0)  # before hosts: ours
        away = store.allocate_replica("web", 1, "fake", "tok-a", 2.0)
        store.update_replica(away, 2.0, host="host-a")
        assert old.host is None
        await ctl._take_over()
        assert infra.swept == [{"tok-b", "tok-old"}]  # tok-a: stale if it runs here
    finally:
        await ctl.stop()
