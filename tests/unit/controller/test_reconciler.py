"""`ServiceReconciler` rounds on a fake infra, a fake LB, mock probes and the fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import httpx
import pytest

from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import ServiceReconciler
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord, ServicePhase, TerminationCause
from fleetserve.infra.base import Infra, InstanceKind
from fleetserve.lb.config import LbConfig
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, host_of, service_yaml, settle

ROUND = 0.25  # seconds of fake time between two rounds


def make_reconciler(
    name: str,
    store: Store,
    infra: Infra,
    lb: FakeLb,
    prober: Prober,
    settings: Settings,
    clock: FakeClock,
) -> ServiceReconciler:
    return ServiceReconciler(name, store, infra, cast(LbManager, lb), prober, settings, clock)


class ProbeAnswers:
    """The replicas' readiness endpoints: 200 for the service "good", 404 for any other;
    each request is logged with the fake time it came at."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, float]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.host, self.clock.now()))
        ok = request.url.host.startswith("good-") and request.url.path == "/health"
        return httpx.Response(200 if ok else 404)

    def times(self, host: str) -> list[float]:
        return [at for h, at in self.calls if h == host]


async def run_rounds(clock: FakeClock, recs: list[ServiceReconciler], rounds: int) -> None:
    for _ in range(rounds):
        clock.advance(ROUND)
        await asyncio.gather(*(rec.reconcile_once() for rec in recs))
        await settle()


@contextlib.asynccontextmanager
async def two_ready(
    store: Store, settings: Settings, clock: FakeClock
) -> AsyncIterator[tuple[ServiceReconciler, FakeInfra, FakeLb, httpx.AsyncClient]]:
    """Service "good" with 2 replicas, after 4 rounds (both READY, its LB started): its
    reconciler, infra, LB manager and the probes' client (answered until the block ends)."""
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        create_service(store, "good", service_yaml(replicas=2), clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=4)
        yield rec, infra, lb, client


def scale_down(rec: ServiceReconciler, row: ReplicaRecord) -> None:
    """Stop `row` as a scale-down does: drained first (up to 120 s)."""
    rec.executor.terminate(
        row, ReplicaStatus.READY, "scaled down", TerminationCause.SCALE_DOWN, drain_seconds=120
    )


@pytest.mark.parametrize("shared_prober", [False, True], ids=["own-probers", "one-prober"])
async def test_a_failing_service_never_marks_anothers_replicas_not_ready(
    store: Store, settings: Settings, clock: FakeClock, shared_prober: bool
) -> None:
    answers = ProbeAnswers(clock)
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client:
        shared = Prober(client)
        recs = []
        for name in ("good", "bad"):
            create_service(store, name, service_yaml(replicas=2), clock.now())
            prober = shared if shared_prober else Prober(client)
            recs.append(make_reconciler(name, store, infra, lb, prober, settings, clock))
        await run_rounds(clock, recs, rounds=60)  # 15 s

    good, bad = store.list_replicas("good"), store.list_replicas("bad")
    assert [r.replica_id for r in good] == [r.replica_id for r in bad] == [1, 2]
    assert [r.status for r in good] == [ReplicaStatus.READY] * 2
    assert [r.status for r in bad] == [ReplicaStatus.STARTING] * 2
    good_events = store.list_events("good", limit=500)
    assert not [e for e in good_events if e.status_to == ReplicaStatus.NOT_READY.value]
    assert not [e for e in good_events if "404" in e.message]
    assert not [e for e in store.list_events("bad", 500) if e.status_to == "READY"]
    for r in good:
        assert r.started_at is not None and r.first_ready_at is not None
        probes = answers.times(host_of("good", r.replica_id))
        # STARTING replicas are probed at once, READY ones again every probe_interval.
        assert probes[0] - r.started_at <= settings.starting_probe_interval
        assert r.first_ready_at - r.started_at <= settings.starting_probe_interval + ROUND
        assert len([t for t in probes if t > r.first_ready_at]) >= 2
    assert len(answers.times(host_of("bad", 1))) >= 10  # bad was probed, and failed, all along
    assert [e.url for e in lb.last_push("good").endpoints] == [
        "http://good-1.test:8000",
        "http://good-2.test:8000",
    ]
    assert lb.last_push("bad").endpoints == ()


@pytest.mark.parametrize(
    ("kind", "final"),
    [(InstanceKind.EXITED, ReplicaStatus.FAILED), (InstanceKind.LOST, ReplicaStatus.PREEMPTED)],
)
async def test_a_replica_that_dies_is_recorded_and_replaced(
    store: Store,
    settings: Settings,
    clock: FakeClock,
    kind: InstanceKind,
    final: ReplicaStatus,
) -> None:
    infra, lb = FakeInfra(), FakeLb()
    answers = ProbeAnswers(clock)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client:
        create_service(store, "good", service_yaml(replicas=1), clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=4)
        assert store.replica("good", 1).status is ReplicaStatus.READY
        infra.set_state("good", 1, kind, exit_code=3 if kind is InstanceKind.EXITED else None)
        await run_rounds(clock, [rec], rounds=6)

    first, second = store.list_replicas("good")
    assert (first.replica_id, first.status) == (1, final)
    assert first.exit_code == (3 if kind is InstanceKind.EXITED else None)
    assert (second.replica_id, second.status) == (2, ReplicaStatus.READY)
    assert ("good/1", first.launch_token) in infra.terminated


async def test_down_stops_every_replica_then_the_lb_then_forgets_the_service(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    async with two_ready(store, settings, clock) as (rec, infra, lb, _client):
        pid = store.service("good").lb_pid
        store.update_service("good", clock.now(), phase=ServicePhase.SHUTTING_DOWN)
        assert await rec.reconcile_once() is True

    assert lb.pushes[-1].endpoints == () and lb.pushes[-1].force
    assert sorted(str(h) for h, _ in infra.terminated) == ["good/1", "good/2"]
    assert lb.stopped == [("good", pid)]
    assert store.get_service("good") is None and store.list_replicas("good") == []
    assert infra.forgotten == ["good"]


async def test_down_does_not_wait_for_a_scale_down_drain(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """A replica draining (scale-down, requests in flight in the LB's last report) when the
    service goes down: the down stops it at once rather than after the drain's 120 s."""
    async with two_ready(store, settings, clock) as (rec, infra, _lb, _client):
        rec.executor.inflight_of = lambda _rid: 3
        scale_down(rec, store.replica("good", 2))
        await settle()
        start = clock.now()
        store.update_service("good", clock.now(), phase=ServicePhase.SHUTTING_DOWN)
        assert await asyncio.wait_for(rec.reconcile_once(), 5) is True
    assert clock.now() - start < 5  # fake time: the drain's sleeps advance it
    assert sorted(str(h) for h, _ in infra.terminated) == ["good/1", "good/2"]
    assert store.get_service("good") is None


@pytest.mark.parametrize(
    ("cause", "final"),
    [
        (TerminationCause.PREEMPTION, ReplicaStatus.PREEMPTED),
        (TerminationCause.FAILURE, ReplicaStatus.FAILED),
    ],
)
async def test_a_restart_finishes_a_stop_with_the_status_of_its_cause(
    store: Store,
    settings: Settings,
    clock: FakeClock,
    cause: TerminationCause,
    final: ReplicaStatus,
) -> None:
    """The controller died while stopping a replica: its successor finishes the stop and
    records how it ended by the cause written on the row (a preemption stays PREEMPTED: not
    a failure, which the crash-loop count and `status` would blame on the replica)."""
    async with two_ready(store, settings, clock) as (rec, infra, lb, client):
        stopping = store.update_replica(
            store.replica("good", 2),
            clock.now(),
            "terminating: lost",
            status=ReplicaStatus.SHUTTING_DOWN,
            termination_cause=cause,
        )
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await rec.recover()
        await asyncio.wait_for(rec.executor.wait_idle(), 5)
    assert (str(stopping.handle), stopping.launch_token) in [
        (str(h), t) for h, t in infra.terminated
    ]
    assert store.replica("good", 2).status is final


async def test_new_lb_settings_retire_the_old_lb_and_drains_wait_for_it(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """New load-balancer settings: a new LB starts (with the controller's drain_seconds),
    the old one is retired (it finishes its requests in the background: the round is not
    held), and a replica's drain waits while it still does (its requests are in no report)."""
    async with two_ready(store, settings, clock) as (rec, infra, lb, _client):
        old = store.service("good").lb_pid
        # The running LB's settings differ from the spec's (as after an update of them; the
        # reconciler compares at each new version or LB pid: told to look again here).
        lb.configs["good"] = lb.configs["good"].model_copy(update={"policy": "round_robin"})
        rec._lb_checked = None
        await run_rounds(clock, [rec], rounds=1)
        svc = store.service("good")
        assert svc.lb_pid != old and lb.retired == [("good", old, settings.drain_seconds)]
        assert lb.started[-1].drain_seconds == settings.drain_seconds
        assert all(s != (None, old) for s in lb.stopped)  # not stopped: retired
        assert "load balancer settings changed: replacing it" in [
            e.message for e in store.list_events("good", 50)
        ]
        # A replica drained now waits for the retiring LB, then goes once it is done.
        rec.executor.inflight_of = lambda _rid: 0
        start = clock.now()
        scale_down(rec, store.replica("good", 2))

        async def finish_later() -> None:
            await clock.sleep(30)
            lb.still_retiring.discard("good")

        await asyncio.gather(finish_later(), asyncio.wait_for(rec.executor.wait_idle(), 5))
    assert 30 <= clock.now() - start < 35
    assert "good/2" in [str(h) for h, _ in infra.terminated]


async def test_a_failed_replacement_leaves_the_old_lb_recorded_and_is_tried_again(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """The new LB (new settings) does not start: the old one serves on and stays the
    service's (before, its pid was dropped and it ran on unseen beside the next one), its
    config file is put back, the error is shown, and the next round tries again."""
    async with two_ready(store, settings, clock) as (rec, _infra, lb, _client):
        old = store.service("good").lb_pid
        running = lb.configs["good"].model_copy(update={"policy": "round_robin"})
        lb.configs["good"] = running
        rec._lb_checked = None
        lb.fail_starts = 1
        await run_rounds(clock, [rec], rounds=1)
        svc = store.service("good")
        assert svc.lb_pid == old and lb.retired == [] and lb.stopped == []
        assert "the old one still serves" in (svc.lb_error or "")
        assert lb.configs["good"] == running  # the running one's config, restored
        await run_rounds(clock, [rec], rounds=1)
        svc = store.service("good")
    assert svc.lb_pid != old and svc.lb_error is None
    assert [(s, p) for s, p, _ in lb.retired] == [("good", old)]


async def test_an_lb_started_by_an_older_fleetserve_is_stopped_not_retired(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """A running LB whose config has no drain_seconds was started by a fleetserve without
    SIGQUIT handling (Python's default would dump core and cut its requests at once): it is
    stopped as before (SIGTERM, 5 s of drain)."""
    async with two_ready(store, settings, clock) as (rec, _infra, lb, _client):
        old = store.service("good").lb_pid
        written = lb.configs["good"].model_dump(mode="json", exclude={"drain_seconds"})
        lb.configs["good"] = LbConfig.model_validate({**written, "policy": "round_robin"})
        rec._lb_checked = None
        await run_rounds(clock, [rec], rounds=1)
    assert store.service("good").lb_pid != old
    assert lb.retired == [] and (None, old) in lb.stopped


async def test_a_restart_relaunches_a_cut_short_launch_and_adopts_the_rest(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    async with two_ready(store, settings, clock) as (rec, infra, lb, client):
        # The controller died while replica 2 was (re)launching.
        cut = store.update_replica(
            store.replica("good", 2), clock.now(), status=ReplicaStatus.PROVISIONING, handle=None
        )
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await rec.recover()
        relaunch = store.replica("good", 2)
        assert (relaunch.status, relaunch.handle) == (ReplicaStatus.PENDING, None)
        assert relaunch.launch_token != cut.launch_token
        assert infra.terminated == [(None, cut.launch_token)]
        assert "adopted after controller restart" in [
            e.message for e in store.list_events("good", 100) if e.replica_id == 1
        ]
        await run_rounds(clock, [rec], rounds=4)

    assert [(r.replica_id, r.status) for r in store.list_replicas("good")] == [
        (1, ReplicaStatus.READY),
        (2, ReplicaStatus.READY),
    ]
    assert infra.launches[-1].launch_token == relaunch.launch_token
    assert len(lb.started) == 1  # the LB that kept running was adopted, not restarted


async def test_a_probe_that_cannot_be_sent_fails_the_replica_not_the_round(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    yaml_text = (
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 3\n"
        "    headers: {X-Probe: caf\u00e9}\n"
        "  replicas: 1\n"
        "run: python3 server.py\n"
    )
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        create_service(store, "good", yaml_text, clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=24)  # 6 s: past the initial delay

    first = store.replica("good", 1)
    assert first.status is ReplicaStatus.FAILED_INITIAL_DELAY
    assert "UnicodeEncodeError" in (first.reason or "")


# -- load-balancer ports ----------------------------------------------------------------------


async def test_two_services_reconciled_together_get_distinct_ports_kept_across_restarts(
    store: Store, settings: Settings, clock: FakeClock, tmp_path: Path
) -> None:
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(ProbeAnswers(clock))) as client:
        names = ("a", "b")
        for name in names:
            create_service(store, name, service_yaml(replicas=1), clock.now())
        recs = [
            make_reconciler(n, store, infra, lb, Prober(client), settings, clock) for n in names
        ]
        await asyncio.gather(*(rec.reconcile_once() for rec in recs))
        ports = {n: store.service(n).lb_port for n in names}
        secrets = {n: store.service(n).lb_secret for n in names}
        assert None not in ports.values() and ports["a"] != ports["b"]
        assert all(secrets.values()) and secrets["a"] != secrets["b"]
        assert {c.service: c.port for c in lb.started} == ports

        # A new controller on the same database (with another port range configured), whose
        # LBs did not survive: each service's LB starts again on the port it had.
        store = Store.at_path(tmp_path / "db.sqlite")
        moved = dataclasses.replace(settings, lb_port_start=settings.lb_port_start + 500)
        lb2 = FakeLb(first_pid=60_000)
        recs = [make_reconciler(n, store, infra, lb2, Prober(client), moved, clock) for n in names]
        await asyncio.gather(*(rec.reconcile_once() for rec in recs))

    assert {c.service: c.port for c in lb2.started} == ports
    assert {n: store.service(n).lb_port for n in names} == ports
    assert {n: store.service(n).lb_secret for n in names} == secrets
    assert {n: store.service(n).lb_pid for n in names} == lb2.pids
    store.close()


def test_interleaved_port_reservations_never_share_a_port(store: Store, clock: FakeClock) -> None:
    for name in ("a", "b"):
        create_service(store, name, service_yaml(), clock.now())
    calls: list[int] = []

    def usable(port: int) -> bool:
        # While "a" looks for a port, "b" takes the first one (another controller, say).
        if not calls:
            store.reserve_lb_port("b", 41_000, lambda _p: True)
        calls.append(port)
        return True

    a = store.reserve_lb_port("a", 41_000, usable)
    b = store.service("b")
    assert b.lb_port == 41_000
    assert a.lb_port == 41_001
    assert store.reserve_lb_port("a", 41_000, usable).lb_port == 41_001  # kept once reserved


@pytest.mark.parametrize("interval", [None, 2.0], ids=["controller-default", "from-yaml"])
async def test_the_yaml_probe_interval_sets_how_often_a_ready_replica_is_probed(
    store: Store, settings: Settings, clock: FakeClock, interval: float | None
) -> None:
    answers = ProbeAnswers(clock)
    yaml_text = service_yaml(replicas=1)
    if interval is not None:
        yaml_text = yaml_text.replace(
            "  replicas:", f"    endpoint_probe_interval_seconds: {interval:g}\n  replicas:"
        )
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client:
        create_service(store, "good", yaml_text, clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=80)  # 20 s
    r = store.replica("good", 1)
    assert r.first_ready_at is not None
    ready_probes = [t for t in answers.times(host_of("good", 1)) if t > r.first_ready_at]
    gaps = [b - a for a, b in itertools.pairwise(ready_probes)]
    expected = interval or settings.probe_interval
    assert gaps and all(expected <= g <= expected + ROUND for g in gaps), gaps


def test_probe_interval_rules() -> None:
    from fleetserve.controller.reconciler import probe_interval
    from fleetserve.spec.models import ReadinessProbe

    s = Settings(home=Path("/nonexistent"), probe_interval=5.0, starting_probe_interval=1.0)
    default, slow, fast = (
        ReadinessProbe(path="/"),
        ReadinessProbe(path="/", endpoint_probe_interval_seconds=30),
        ReadinessProbe(path="/", endpoint_probe_interval_seconds=0.5),
    )
    assert probe_interval(ReplicaStatus.READY, default, s) == 5.0
    assert probe_interval(ReplicaStatus.READY, slow, s) == 30
    assert probe_interval(ReplicaStatus.NOT_READY, fast, s) == 0.5
    assert probe_interval(ReplicaStatus.STARTING, slow, s) == 1.0  # readiness noticed at once
    assert probe_interval(ReplicaStatus.STARTING, fast, s) == 0.5


@pytest.mark.parametrize(("window", "failed"), [(None, False), (3.0, True)])
async def test_the_yaml_failure_window_sets_when_a_failing_replica_is_failed(
    store: Store, settings: Settings, clock: FakeClock, window: float | None, failed: bool
) -> None:
    healthy = [True]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if healthy[0] else 500)

    yaml_text = service_yaml(replicas=1)
    if window is not None:
        yaml_text = yaml_text.replace(
            "  replicas:", f"    consecutive_failure_threshold_timeout: {window:g}\n  replicas:"
        )
    infra, lb = FakeInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        create_service(store, "good", yaml_text, clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=8)
        assert store.replica("good", 1).status is ReplicaStatus.READY
        healthy[0] = False
        await run_rounds(clock, [rec], rounds=60)  # 15 s of failing probes: < 180 s default
    status = store.replica("good", 1).status
    assert (status is ReplicaStatus.FAILED_PROBING) is failed, status


class ListeningInfra(FakeInfra):
    """A fake infra whose replicas' processes listen on port 9000 (not the probed 8000)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def listening_ports(self, handle: str) -> list[int] | None:
        self.reads += 1
        return [9000]


async def test_a_probe_that_cannot_connect_names_the_port_probed_and_the_ports_listened_on(
    store: Store, settings: Settings, clock: FakeClock
) -> None:
    """A server that listens on 0.0.0.0, on another port than the service's: the reason says
    which port the probe used and which ones the replica's processes listen on, not only
    "listen on 0.0.0.0"."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    yaml_text = (
        "service:\n  readiness_probe: {path: /health, initial_delay_seconds: 3}\n"
        "  replicas: 1\nrun: python3 server.py\n"
    )
    infra, lb = ListeningInfra(), FakeLb()
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        create_service(store, "good", yaml_text, clock.now())
        rec = make_reconciler("good", store, infra, lb, Prober(client), settings, clock)
        await run_rounds(clock, [rec], rounds=24)  # 6 s: past the initial delay

    first = store.replica("good", 1)
    assert first.status is ReplicaStatus.FAILED_INITIAL_DELAY
    reason = first.reason or ""
    assert f"nothing accepts connections at {host_of('good', 1)}:8000, the address probed" in (
        reason
    ), reason
    assert "the replica's processes listen on 9000" in reason, reason
    assert 1 <= infra.reads <= 3  # read at most every 5 s, not at every probe
