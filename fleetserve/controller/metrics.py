"""The controller's Prometheus metrics, served at `GET /metrics` on the API port (behind the
API token, like every route but /api/v1/health). docs/metrics.md lists them.

Two kinds:

- counted as things happen: replica transitions, launches, terminations, failures (from the
  store's status transitions), probes (from the prober), reconcile rounds (from the
  reconciler). A service's labelled children are made once and kept by its `ServiceMetrics`,
  so a hot path costs a dict lookup at most; they are removed when the service is deleted.
- read from the store at scrape time (`FleetCollector`): replicas by status, target vs ready,
  rollout progress. Always right, after a controller restart too, and a deleted service has
  none.

Every label value is bounded: service names (the spec bounds them), statuses, reasons and
outcomes (enums), versions that still have replicas. No free text ever becomes a label.
The registry is the controller's own, never prometheus_client's global one.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetserve.controller.pools import STATE_KEY as POOL_STATE_KEY
from fleetserve.controller.scaling import STATE_KEY as AUTOSCALER_STATE_KEY
from fleetserve.core.errors import NotFound
from fleetserve.core.service_status import service_status
from fleetserve.core.status import (
    TERMINAL_STATUSES,
    ReplicaStatus,
    ServiceStatus,
)
from fleetserve.core.types import ReplicaRecord, ServiceRecord, TerminationCause
from fleetserve.spec.models import ServiceTask
from fleetserve.store import Store

log = logging.getLogger("fleetserve.controller")

# Seconds. Probes answer in milliseconds when healthy and time out after seconds; a round is
# milliseconds of database work, longer when a launch or a push waits.
PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ProbeOutcome(enum.StrEnum):
    """How a readiness probe ended (the `outcome` label of fleetserve_controller_probes_total)."""

    OK = "ok"  # HTTP 200
    HTTP_STATUS = "http_status"  # answered, with another status
    TIMEOUT = "timeout"  # no answer within the probe's timeout_seconds
    CONNECT_ERROR = "connect_error"  # nothing accepts connections there (yet)
    ERROR = "error"  # any other failure: reset, closed, malformed answer
    FOREIGN_LISTENER = "foreign_listener"  # the port is held by another user's process


class TerminationReason(enum.StrEnum):
    """Why the controller stopped a replica (the `reason` label of
    fleetserve_controller_replica_terminations_total)."""

    SCALE_DOWN = "scale_down"  # the fleet shrank (or a spot fleet retired an on-demand spare)
    ROLLOUT = "rollout"  # replaced by a newer version
    USER = "user"  # `fleetserve terminate` / POST .../replicas/N/terminate
    SERVICE_DOWN = "service_down"  # `fleetserve down`
    FAILURE = "failure"  # failed or preempted (..._replica_failures_total says how it ended)


# The label of each cause (`failure` also counts preemptions and lost hosts).
_REASON_OF = {
    TerminationCause.SCALE_DOWN: TerminationReason.SCALE_DOWN,
    TerminationCause.ROLLOUT: TerminationReason.ROLLOUT,
    TerminationCause.USER: TerminationReason.USER,
    TerminationCause.SERVICE_DOWN: TerminationReason.SERVICE_DOWN,
    TerminationCause.FAILURE: TerminationReason.FAILURE,
    TerminationCause.PREEMPTION: TerminationReason.FAILURE,
    TerminationCause.HOST_LOST: TerminationReason.FAILURE,
}

LAUNCH_KINDS = ("on_demand", "spot")
# How a replica can end badly: the `reason` label of fleetserve_controller_replica_failures_total.
FAILURE_REASONS = tuple(s for s in ReplicaStatus if s in TERMINAL_STATUSES)


def termination_reason(rec: ReplicaRecord) -> TerminationReason:
    """Why `rec`, just marked SHUTTING_DOWN, is being stopped: the label of its cause."""
    if rec.termination_cause is None:  # not written by the executor (never, but not a crash)
        return TerminationReason.FAILURE
    return _REASON_OF[rec.termination_cause]


class ServiceMetrics:
    """One service's labelled children, made once: what the hot paths increment."""

    def __init__(self, parent: ControllerMetrics, service: str) -> None:
        self.parent = parent
        self.service = service
        self.timer = parent.timer
        self._children: list[tuple[Any, tuple[str, ...]]] = []  # for forget()
        # Shown at 0 from the start, so that rate() and increase() see the first one.
        self._launches = {k: self._child(parent.launches, k) for k in LAUNCH_KINDS}
        self._terminations = {
            r: self._child(parent.terminations, r.value) for r in TerminationReason
        }
        self._failures = {s: self._child(parent.failures, s.value) for s in FAILURE_REASONS}
        self._probes = {o: self._child(parent.probes, o.value) for o in ProbeOutcome}
        self._probe_seconds = self._child(parent.probe_seconds)
        self._round_seconds = self._child(parent.round_seconds)
        self._round_errors = self._child(parent.round_errors)
        self._transitions: dict[ReplicaStatus, Any] = {}  # made on first use: 13 at most
        # signal -> (value child, replicas child): made on first use, 11 at most
        # (queue, kv_cache, metric:0..7, latency_ms)
        self._signals: dict[str, tuple[Any, Any]] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        values = (self.service, *labels)
        self._children.append((metric, values))
        return metric.labels(*values)

    def transition(self, old: ReplicaStatus | None, rec: ReplicaRecord) -> None:
        """A replica's status changed from `old` (None: a new row) to `rec.status`."""
        status = rec.status
        child = self._transitions.get(status)
        if child is None:
            child = self._transitions[status] = self._child(self.parent.transitions, status.value)
        child.inc()
        if status is ReplicaStatus.PROVISIONING:
            self._launches["spot" if rec.spot else "on_demand"].inc()
        elif status is ReplicaStatus.SHUTTING_DOWN:
            self._terminations[termination_reason(rec)].inc()
        elif status in TERMINAL_STATUSES:
            self._failures[status].inc()

    def probe(self, seconds: float, outcome: ProbeOutcome) -> None:
        self._probe_seconds.observe(seconds)
        self._probes[outcome].inc()

    def signal(self, name: str, value: float | None, answered: int | None = None) -> None:
        """What the autoscaler last read of a signal: its value (None: nothing read, NaN
        shown) and, for a replica-reported one, how many READY replicas answered."""
        pair = self._signals.get(name)
        if pair is None:
            pair = self._signals[name] = (
                self._child(self.parent.signal_values, name),
                self._child(self.parent.signal_replicas, name),
            )
        pair[0].set(math.nan if value is None else value)
        if answered is not None:
            pair[1].set(answered)

    def round(self, seconds: float, failed: bool = False) -> None:
        """One reconcile round took `seconds` (and raised, when `failed`)."""
        self._round_seconds.observe(seconds)
        if failed:
            self._round_errors.inc()

    def forget(self) -> None:
        """Remove every series of the service (it was deleted)."""
        self.parent.forget(self.service)


class ControllerMetrics:
    """The controller's registry: counters of what happened, and the store's collector."""

    def __init__(
        self,
        store: Store | None = None,
        timer: Callable[[], float] = time.perf_counter,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.timer = timer  # for durations: monotonic seconds
        reg = self.registry
        self.transitions = Counter(
            "fleetserve_controller_replica_transitions",
            "Replica status changes, by the status entered.",
            ["service", "status"],
            registry=reg,
        )
        self.launches = Counter(
            "fleetserve_controller_replica_launches",
            "Replica launches started (PENDING -> PROVISIONING), by kind (on_demand, spot).",
            ["service", "kind"],
            registry=reg,
        )
        self.terminations = Counter(
            "fleetserve_controller_replica_terminations",
            "Replicas the controller started to stop (-> SHUTTING_DOWN), by reason.",
            ["service", "reason"],
            registry=reg,
        )
        self.failures = Counter(
            "fleetserve_controller_replica_failures",
            "Replicas that ended badly, by the status they ended in (FAILED_*, PREEMPTED...).",
            ["service", "reason"],
            registry=reg,
        )
        self.probes = Counter(
            "fleetserve_controller_probes",
            "Readiness probes, by outcome (ok, http_status, timeout, connect_error, ...).",
            ["service", "outcome"],
            registry=reg,
        )
        self.probe_seconds = Histogram(
            "fleetserve_controller_probe_duration_seconds",
            "Time a readiness probe took, failed ones included.",
            ["service"],
            buckets=PROBE_BUCKETS,
            registry=reg,
        )
        self.round_seconds = Histogram(
            "fleetserve_controller_reconcile_duration_seconds",
            "Time one reconcile round (observe, plan, act) of a service took.",
            ["service"],
            buckets=ROUND_BUCKETS,
            registry=reg,
        )
        self.round_errors = Counter(
            "fleetserve_controller_reconcile_errors",
            "Reconcile rounds that raised (the next one retries, with backoff).",
            ["service"],
            registry=reg,
        )
        self.signal_values = Gauge(
            "fleetserve_controller_autoscaler_signal",
            "What the autoscaler last read of each signal it scales on: queue and metric:N "
            "per replica (mean, or max with aggregation max), kv_cache as a fraction, "
            "latency_ms; NaN when nothing was read.",
            ["service", "signal"],
            registry=reg,
        )
        self.signal_replicas = Gauge(
            "fleetserve_controller_autoscaler_signal_replicas",
            "READY replicas whose metrics answered for the signal in the last scrape.",
            ["service", "signal"],
            registry=reg,
        )
        self._services: dict[str, ServiceMetrics] = {}
        if store is not None:
            reg.register(FleetCollector(store, active))
            store.replica_listeners.append(self.transition)

    def service(self, name: str) -> ServiceMetrics:
        handle = self._services.get(name)
        if handle is None:
            handle = self._services[name] = ServiceMetrics(self, name)
        return handle

    def transition(self, old: ReplicaStatus | None, rec: ReplicaRecord) -> None:
        """The store's hook: called after each replica status change is committed."""
        self.service(rec.service).transition(old, rec)

    def forget(self, name: str) -> None:
        """A deleted service leaves no series behind (prometheus_client's remove())."""
        handle = self._services.pop(name, None)
        if handle is None:
            return
        for metric, values in handle._children:
            metric.remove(*values)

    def render(self) -> bytes:
        """The Prometheus text exposition (prometheus_client.CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry)


# -- read at scrape time ------------------------------------------------------------------


@dataclass(frozen=True)
class _Facts:
    """What a scrape needs of a service's active spec (parsed once per version)."""

    lo: int
    hi: int
    pool: bool
    autoscaled: bool
    spec: ServiceTask  # for the status (fleetserve.core.service_status)


def _facts(spec: ServiceTask) -> _Facts:
    lo, hi = spec.service.fleet_bounds()
    if spec.service.pool is not None:
        return _Facts(lo, hi, pool=True, autoscaled=lo != hi, spec=spec)
    policy = spec.service.replica_policy
    return _Facts(
        lo, hi, pool=False, autoscaled=policy is not None and policy.autoscaled, spec=spec
    )


class FleetCollector(Collector):
    """Gauges read from the store at each scrape."""

    def __init__(self, store: Store, active: Callable[[], bool] = lambda: True) -> None:
        self.store = store
        # A standby (FLEETSERVE_HA) reports only that it is one: scraping every controller
        # must not count the fleet twice.
        self.active = active
        self._facts: dict[tuple[str, float, int], _Facts] = {}

    def describe(self) -> Iterable[Metric]:
        return []  # nothing is read from the store when the collector is registered

    def _facts_of(self, svc: ServiceRecord) -> _Facts:
        key = (svc.name, svc.created_at, svc.active_version)  # a new service of that name too
        facts = self._facts.get(key)
        if facts is None:
            raw = self.store.version(svc.name, svc.active_version).spec_json
            facts = self._facts[key] = _facts(ServiceTask.model_validate_json(raw))
        return facts

    def _target(self, svc: ServiceRecord, facts: _Facts) -> int:
        """The replicas wanted now: the autoscaler's (or the pool's) last decision, else the
        fixed count (what `fleetserve status` shows)."""
        if not facts.autoscaled and not facts.pool:
            return facts.lo
        key = POOL_STATE_KEY if facts.pool else AUTOSCALER_STATE_KEY
        state = self.store.get_policy_state(svc.name, key)
        target = state.get("target") if state else None
        return target if isinstance(target, int) else facts.lo

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"fleetserve_controller_{name}", doc, labels=labels)

        role = gauge(
            "active",
            "1 on the active controller, 0 on a standby (the fleet's "
            "gauges come from the active one only).",
            [],
        )
        acting = self.active()
        role.add_metric([], 1.0 if acting else 0.0)
        if not acting:
            return [role]

        s, sv = ["service"], ["service", "version"]
        services = gauge("services", "Services (and pools) the controller runs.", [])
        replicas = gauge("replicas", "Replicas by status.", ["service", "status"])
        ready = gauge("ready_replicas", "READY replicas (all versions).", s)
        target = gauge("target_replicas", "Replicas wanted now (autoscaler or fixed).", s)
        lo = gauge("min_replicas", "The spec's lower bound (pools: min workers).", s)
        hi = gauge("max_replicas", "The spec's upper bound (pools: max workers).", s)
        status = gauge("service_status", "1 for the service's status.", ["service", "status"])
        active = gauge("active_version", "The version being deployed (the newest).", s)
        serving = gauge("serving_version", "The version that serves until a rollout ends.", s)
        rolling = gauge("rollout_in_progress", "1 while a rollout is under way.", s)
        by_version = gauge("version_ready_replicas", "READY replicas of each live version.", sv)
        percent = gauge(
            "traffic_percent", "A canary's share of traffic for the active version, in %.", s
        )
        alive = 0
        known: set[tuple[str, float, int]] = set()
        for svc in self.store.list_services():
            try:
                facts = self._facts_of(svc)
            except NotFound:
                continue  # deleted between the two reads
            known.add((svc.name, svc.created_at, svc.active_version))
            alive += 1
            rows = self.store.list_replicas(svc.name)
            counts = dict.fromkeys(ReplicaStatus, 0)
            for r in rows:
                counts[r.status] += 1
            for st, n in counts.items():
                replicas.add_metric([svc.name, st.value], n)
            ready.add_metric([svc.name], counts[ReplicaStatus.READY])
            target.add_metric([svc.name], self._target(svc, facts))
            lo.add_metric([svc.name], facts.lo)
            hi.add_metric([svc.name], facts.hi)
            now = service_status(svc, rows, facts.spec)
            for st_ in ServiceStatus:
                status.add_metric([svc.name, st_.value], 1 if st_ is now else 0)
            active.add_metric([svc.name], svc.active_version)
            serving.add_metric([svc.name], svc.serving_version)
            rolling.add_metric([svc.name], 1 if svc.rolling_out else 0)
            live = {svc.active_version, svc.serving_version}
            live |= {r.version for r in rows if not r.status.is_terminal}
            for version in sorted(live):
                n = sum(1 for r in rows if r.version == version and r.status is ReplicaStatus.READY)
                by_version.add_metric([svc.name, str(version)], n)
            if svc.traffic_percent is not None and svc.rolling_out:
                percent.add_metric([svc.name], svc.traffic_percent)
        for key in set(self._facts) - known:
            del self._facts[key]  # deleted services and past versions
        services.add_metric([], alive)
        return [
            role,
            services,
            replicas,
            ready,
            target,
            lo,
            hi,
            status,
            active,
            serving,
            rolling,
            by_version,
            percent,
        ]
