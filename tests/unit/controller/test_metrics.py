"""The controller's Prometheus metrics (fleetserve.controller.metrics): counters fed by the
store's replica transitions, the prober and the reconciler's rounds; gauges read from the store
at scrape time; nothing left behind by a deleted service. Values are asserted, not presence."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.controller import controller as controller_module
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.metrics import (
    FAILURE_REASONS,
    ControllerMetrics,
    ProbeOutcome,
    TerminationReason,
    termination_reason,
)
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import ServiceReconciler
from fleetserve.controller.scaling import STATE_KEY
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus, ServiceStatus
from fleetserve.core.types import ReplicaKey, ReplicaRecord, ServicePhase, TerminationCause
from fleetserve.policies.fleet import plan_shutdown
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.models import ReadinessProbe
from fleetserve.store import Store

from .fakes import FakeInfra, FakeLb, create_service, service_yaml, settle

AUTOSCALED = """\
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: 1
    max_replicas: 5
    target_qps_per_replica: 2
run: python3 server.py
"""
LAUNCHES = "fleetserve_controller_replica_launches_total"


def value(m: ControllerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def series_of(m: ControllerMetrics, service: str) -> list[str]:
    """Every sample (name and labels) of `service` in a scrape."""
    text = m.render().decode()
    return [
        f"{s.name}{s.labels}"
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.labels.get("service") == service
    ]


def step(store: Store, rec: ReplicaRecord, status: ReplicaStatus, **fields: Any) -> ReplicaRecord:
    return store.update_replica(rec, 1.0, status=status, **fields)


def test_launches_terminations_failures_and_transitions_are_counted_from_the_store(
    store: Store, clock: FakeClock
) -> None:
    m = ControllerMetrics(store)
    create_service(store, "web", service_yaml(replicas=2), clock.now())

    a = store.allocate_replica("web", 1, "fake", "tok-a", clock.now())
    a = step(store, a, ReplicaStatus.PROVISIONING)
    a = step(store, a, ReplicaStatus.STARTING)
    a = step(store, a, ReplicaStatus.READY)
    a = store.update_replica(a, 2.0, message="no status change", endpoint="http://x")
    a = step(
        store,
        a,
        ReplicaStatus.SHUTTING_DOWN,
        reason="probe failed",
        termination_cause=TerminationCause.FAILURE,
    )
    step(store, a, ReplicaStatus.FAILED_PROBING)

    b = store.allocate_replica("web", 1, "fake", "tok-b", clock.now(), spot=True)
    b = step(store, b, ReplicaStatus.PROVISIONING)
    step(store, b, ReplicaStatus.FAILED_PROVISION)

    c = store.allocate_replica("web", 1, "fake", "tok-c", clock.now())
    c = step(store, c, ReplicaStatus.PROVISIONING)
    step(
        store,
        c,
        ReplicaStatus.SHUTTING_DOWN,
        reason="scaled down",
        termination_cause=TerminationCause.SCALE_DOWN,
    )

    def launches(kind: str) -> float | None:
        return value(m, LAUNCHES, service="web", kind=kind)

    def failures(reason: str) -> float | None:
        return value(
            m, "fleetserve_controller_replica_failures_total", service="web", reason=reason
        )

    def ended(reason: str) -> float | None:
        name = "fleetserve_controller_replica_terminations_total"
        return value(m, name, service="web", reason=reason)

    def entered(status: str) -> float | None:
        name = "fleetserve_controller_replica_transitions_total"
        return value(m, name, service="web", status=status)

    assert (launches("on_demand"), launches("spot")) == (2, 1)
    # Each reason shows from a service's first transition, at 0 until it happens.
    assert failures("FAILED_PROBING") == failures("FAILED_PROVISION") == 1
    assert failures("PREEMPTED") == failures("FAILED") == 0
    assert {r.value for r in FAILURE_REASONS} >= {"FAILED_PROBING", "PREEMPTED", "FAILED"}
    assert ended("failure") == ended("scale_down") == 1
    assert ended("rollout") == ended("user") == ended("service_down") == 0
    assert entered("PENDING") == 3 and entered("PROVISIONING") == 3
    assert entered("READY") == entered("STARTING") == 1  # an update without a status: none
    assert entered("SHUTTING_DOWN") == 2 and entered("NOT_READY") is None  # made on first use


def test_a_failing_metrics_hook_never_fails_a_state_change(store: Store, clock: FakeClock) -> None:
    def broken(_old: ReplicaStatus | None, _rec: ReplicaRecord) -> None:
        raise RuntimeError("boom")

    store.replica_listeners.append(broken)
    m = ControllerMetrics(store)
    create_service(store, "web", service_yaml(), clock.now())
    rec = store.allocate_replica("web", 1, "fake", "tok", clock.now())
    step(store, rec, ReplicaStatus.PROVISIONING)
    assert store.replica("web", 1).status is ReplicaStatus.PROVISIONING
    assert value(m, LAUNCHES, service="web", kind="on_demand") == 1


def test_termination_reasons_are_the_labels_of_the_recorded_causes() -> None:
    """The label comes from the cause written on the row, never from the reason's words."""
    rec = ReplicaRecord("web", 1, 1, ReplicaStatus.SHUTTING_DOWN, reason="replaced by version 3")

    def reason(cause: TerminationCause | None) -> TerminationReason:
        return termination_reason(dataclasses.replace(rec, termination_cause=cause))

    C, L = TerminationCause, TerminationReason
    assert {c: reason(c) for c in C} == {
        C.SCALE_DOWN: L.SCALE_DOWN,
        C.ROLLOUT: L.ROLLOUT,
        C.USER: L.USER,
        C.SERVICE_DOWN: L.SERVICE_DOWN,
        C.FAILURE: L.FAILURE,
        C.PREEMPTION: L.FAILURE,
        C.HOST_LOST: L.FAILURE,  # another host's replica is lost, not scaled down
    }
    assert reason(None) is L.FAILURE
    down = plan_shutdown([dataclasses.replace(rec, status=ReplicaStatus.READY)])[0]
    assert reason(down.cause) is L.SERVICE_DOWN
    assert "TerminationCause.USER" in inspect.getsource(controller_module.Controller)


def test_scrape_time_gauges_read_the_store(store: Store, clock: FakeClock) -> None:
    m = ControllerMetrics(store)
    create_service(store, "web", service_yaml(replicas=3), clock.now())
    store.update_service("web", clock.now(), lb_pid=123)
    for token, status in [("a", "READY"), ("b", "READY"), ("c", "STARTING"), ("d", "FAILED")]:
        rec = store.allocate_replica("web", 1, "fake", token, clock.now())
        step(store, rec, ReplicaStatus(status))

    create_service(store, "auto", AUTOSCALED, clock.now())
    store.put_policy_state("auto", STATE_KEY, {"target": 4}, clock.now())

    # A canary of version 2 at 20 % of the traffic, one READY replica of each version.
    create_service(store, "canary", service_yaml(replicas=1), clock.now())
    yaml = service_yaml(replicas=1)
    v2 = store.add_version("canary", yaml, parse_spec(yaml).model_dump_json(), clock.now())
    store.update_service(
        "canary", clock.now(), active_version=v2, stable_version=1, traffic_percent=20, lb_pid=9
    )
    for version in (1, v2):
        rec = store.allocate_replica("canary", version, "fake", f"v{version}", clock.now())
        step(store, rec, ReplicaStatus.READY)

    def g(name: str, service: str, **labels: str) -> float | None:
        return value(m, f"fleetserve_controller_{name}", service=service, **labels)

    for fresh in (m, ControllerMetrics(store)):  # a restarted controller reads the same
        assert value(fresh, "fleetserve_controller_services") == 3
        assert value(fresh, "fleetserve_controller_replicas", service="web", status="READY") == 2
        assert value(fresh, "fleetserve_controller_replicas", service="web", status="FAILED") == 1
        assert value(fresh, "fleetserve_controller_replicas", service="web", status="PENDING") == 0
    assert (g("ready_replicas", "web"), g("target_replicas", "web")) == (2, 3)
    assert (g("min_replicas", "web"), g("max_replicas", "web")) == (3, 3)
    assert g("service_status", "web", status=ServiceStatus.READY.value) == 1
    assert g("service_status", "web", status=ServiceStatus.FAILED.value) == 0
    assert g("service_status", "auto", status=ServiceStatus.CONTROLLER_INIT.value) == 1
    # The autoscaler's last decision, between the spec's bounds.
    assert (g("target_replicas", "auto"), g("ready_replicas", "auto")) == (4, 0)
    assert (g("min_replicas", "auto"), g("max_replicas", "auto")) == (1, 5)
    # Rollout progress: which version is deployed, which serves, READY replicas of each.
    assert (g("active_version", "web"), g("serving_version", "web")) == (1, 1)
    assert g("rollout_in_progress", "web") == 0 and g("traffic_percent", "web") is None
    assert (g("active_version", "canary"), g("serving_version", "canary")) == (2, 1)
    assert g("rollout_in_progress", "canary") == 1 and g("traffic_percent", "canary") == 20
    assert g("version_ready_replicas", "canary", version="1") == 1
    assert g("version_ready_replicas", "canary", version="2") == 1
    assert g("version_ready_replicas", "web", version="1") == 2

    # The rollout ends: version 1's replica goes, and so does its series.
    store.update_service("canary", clock.now(), stable_version=v2, traffic_percent=None)
    store.delete_replica("canary", 1, clock.now(), "replaced")
    assert g("rollout_in_progress", "canary") == 0 and g("traffic_percent", "canary") is None
    assert g("version_ready_replicas", "canary", version="1") is None


def test_a_deleted_service_leaves_no_series(store: Store, clock: FakeClock) -> None:
    m = ControllerMetrics(store)
    for name in ("gone", "kept"):
        create_service(store, name, service_yaml(), clock.now())
        rec = store.allocate_replica(name, 1, "fake", f"t-{name}", clock.now())
        step(store, rec, ReplicaStatus.PROVISIONING)
        m.service(name).probe(0.01, ProbeOutcome.OK)
        m.service(name).round(0.002)
    assert series_of(m, "gone") and len(series_of(m, "gone")) == len(series_of(m, "kept"))

    store.delete_service("gone")
    m.forget("gone")
    assert series_of(m, "gone") == []
    assert value(m, LAUNCHES, service="kept", kind="on_demand") == 1

    # A new service of that name starts from zero.
    create_service(store, "gone", service_yaml(), clock.now())
    rec = store.allocate_replica("gone", 1, "fake", "t-new", clock.now())
    assert value(m, LAUNCHES, service="gone", kind="on_demand") == 0
    step(store, rec, ReplicaStatus.PROVISIONING)
    assert value(m, LAUNCHES, service="gone", kind="on_demand") == 1


async def test_probes_are_timed_and_counted_by_outcome(clock: FakeClock) -> None:
    seconds = {"ok": 0.004, "slow": 0.3, "bad": 0.02}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host.split("-")[0]
        if host == "refused":
            raise httpx.ConnectError("All connection attempts failed")
        if host == "hung":
            clock.advance(2.0)
            raise httpx.ReadTimeout("timed out")
        clock.advance(seconds[host])
        return httpx.Response(503 if host == "bad" else 200)

    m = ControllerMetrics(timer=clock.now)
    probe = ReadinessProbe(path="/health", timeout_seconds=2)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        prober = Prober(client)
        prober.metrics = m
        for i, host in enumerate(["ok", "ok", "slow", "bad", "refused", "hung"]):
            key = ReplicaKey("web", i + 1)
            prober.maybe_start(key, f"http://{host}-{i}.test:8000", probe, now=0.0, interval=1.0)
            await settle()  # one at a time: each probe's duration is its own
            assert prober.take(key) is not None

    def probes(outcome: ProbeOutcome) -> float | None:
        name = "fleetserve_controller_probes_total"
        return value(m, name, service="web", outcome=outcome.value)

    assert probes(ProbeOutcome.OK) == 3
    assert probes(ProbeOutcome.HTTP_STATUS) == probes(ProbeOutcome.CONNECT_ERROR) == 1
    assert probes(ProbeOutcome.TIMEOUT) == 1 and probes(ProbeOutcome.FOREIGN_LISTENER) == 0
    hist = "fleetserve_controller_probe_duration_seconds"
    assert value(m, f"{hist}_count", service="web") == 6
    assert value(m, f"{hist}_sum", service="web") == pytest.approx(0.004 * 2 + 0.3 + 0.02 + 2.0)
    assert value(m, f"{hist}_bucket", service="web", le="0.005") == 3  # the two ok + refused
    assert value(m, f"{hist}_bucket", service="web", le="0.5") == 5
    assert value(m, f"{hist}_bucket", service="web", le="2.5") == 6


async def test_rounds_are_timed_and_a_service_taken_down_leaves_no_series(
    store: Store, clock: FakeClock, tmp_path: Path
) -> None:
    ticks = itertools.count(0.0, 0.5)  # every reading of the timer is 0.5 s after the last
    m = ControllerMetrics(store, timer=lambda: next(ticks))
    settings = Settings(home=tmp_path, reconcile_interval=0.01)
    infra, lb = FakeInfra(), FakeLb()
    create_service(store, "web", service_yaml(replicas=2), clock.now())

    def ok(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as client:
        prober = Prober(client)
        rec = ServiceReconciler(
            "web", store, infra, cast(LbManager, lb), prober, settings, clock, metrics=m
        )
        assert prober.metrics is m
        prober.metrics = None  # only the rounds read the timer: each round is 0.5 s
        task = asyncio.create_task(rec.run())
        hist = "fleetserve_controller_reconcile_duration_seconds"
        try:
            async with asyncio.timeout(10):
                while (value(m, "fleetserve_controller_ready_replicas", service="web") or 0) < 2:
                    await asyncio.sleep(0.01)
            rounds = value(m, f"{hist}_count", service="web") or 0
            assert rounds >= 2
            assert value(m, f"{hist}_sum", service="web") == pytest.approx(0.5 * rounds)
            assert value(m, f"{hist}_bucket", service="web", le="0.25") == 0
            assert value(m, f"{hist}_bucket", service="web", le="0.5") == rounds
            assert value(m, "fleetserve_controller_reconcile_errors_total", service="web") == 0
            assert value(m, LAUNCHES, service="web", kind="on_demand") == 2

            store.update_service("web", clock.now(), phase=ServicePhase.SHUTTING_DOWN)
            rec.wake.set()
            async with asyncio.timeout(10):
                await rec.finished.wait()
        finally:
            task.cancel()
            await rec.stop()
    assert store.get_service("web") is None
    assert series_of(m, "web") == []
    assert value(m, "fleetserve_controller_services") == 0


def test_a_standby_reports_only_that_it_is_one(store: Store, clock: FakeClock) -> None:
    """Scraping both controllers of a high-availability pair counts the fleet once."""
    create_service(store, "web", service_yaml(replicas=2), clock.now())
    acting = [False]
    metrics = ControllerMetrics(store, active=lambda: acting[0])
    assert value(metrics, "fleetserve_controller_active") == 0
    assert value(metrics, "fleetserve_controller_services") is None
    acting[0] = True  # it took the lease
    assert value(metrics, "fleetserve_controller_active") == 1
    assert value(metrics, "fleetserve_controller_services") == 1


def test_the_autoscalers_last_readings_are_gauges_and_go_with_the_service() -> None:
    metrics = ControllerMetrics()
    svc = metrics.service("llm")
    svc.signal("queue", 7.5, answered=2)
    svc.signal("latency_ms", None)
    samples = {
        (s.name, s.labels.get("signal")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.labels.get("service") == "llm"
    }
    assert samples[("fleetserve_controller_autoscaler_signal", "queue")] == 7.5
    assert samples[("fleetserve_controller_autoscaler_signal_replicas", "queue")] == 2
    latency = samples[("fleetserve_controller_autoscaler_signal", "latency_ms")]
    assert latency != latency  # NaN: nothing measured
    metrics.forget("llm")
    assert b'service="llm"' not in metrics.render()
