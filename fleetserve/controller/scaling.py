"""`Scaler`: the fleet's target size, from the load balancer's load reports through the pure
autoscaler (fleetserve.policies.autoscaler), with the autoscaler's state persisted after each
decision so that a restarted controller carries on where it stopped."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from fleetserve.controller.history import window_percentile_ms
from fleetserve.core.clock import Clock
from fleetserve.core.types import ReplicaId
from fleetserve.lb.messages import LoadReport
from fleetserve.policies.autoscaler import (
    AutoscalerState,
    Decision,
    LoadObservation,
    SignalReading,
    autoscale,
    initial_state,
)
from fleetserve.spec.models import ReplicaPolicy, ServiceTask
from fleetserve.store import Store

log = logging.getLogger("fleetserve.controller")
STATE_KEY = "autoscaler"


class Scaler:
    def __init__(self, service: str, store: Store, clock: Clock, interval: float = 1.0) -> None:
        self.service = service
        self.store = store
        self.clock = clock
        self.interval = interval
        self.load: LoadReport | None = None  # the LB's latest report
        self.last: Decision | None = None
        self._last_total: int | None = None
        self._pending = 0  # requests seen since the last decision
        self._decided_at = float("-inf")
        # (when, report) of the last `qps_window_seconds` and one before: the latency window.
        self._reports: deque[tuple[float, LoadReport]] = deque()
        self._latency_window = 0.0  # seconds of reports kept: none past the last two without
        self.signals: Mapping[str, SignalReading] = {}  # the replicas' last readings
        self.latency_ms: float | None = None  # the last latency measured

    def inflight_of(self, replica_id: ReplicaId) -> int:
        replica = self.load.replicas.get(str(replica_id)) if self.load is not None else None
        return replica.inflight if replica is not None else 0

    def observe(self, report: LoadReport | None) -> None:
        if report is None:
            return
        self.load = report
        now = self.clock.now()
        self._reports.append((now, report))
        while len(self._reports) > 2 and self._reports[1][0] <= now - self._latency_window:
            self._reports.popleft()
        total = report.total_requests
        if self._last_total is not None:
            # A restarted load balancer counts from zero again.
            self._pending += total - self._last_total if total >= self._last_total else total
        self._last_total = total

    def latency(self, policy: ReplicaPolicy) -> float | None:
        """The latency percentile the LB measured over the last `qps_window_seconds` (between
        the newest report and the last one at least that old; the oldest kept before that)."""
        if policy.latency_target_ms is None:
            self._latency_window = 0.0
            return None
        self._latency_window = policy.qps_window_seconds
        if not self._reports:
            return None
        _at, cur = self._reports[-1]
        prev = self._reports[0][1] if len(self._reports) > 1 else None
        return window_percentile_ms(
            prev,
            cur,
            policy.latency_percentile / 100,
            first_byte=policy.target_ttft_ms is not None,
        )

    def target(self, spec: ServiceTask, signals: Mapping[str, SignalReading] | None = None) -> int:
        """Replicas wanted now: min_replicas for a fixed fleet, else the autoscaler's.
        `signals`: what the READY replicas reported (fleetserve.controller.replica_metrics)."""
        policy = spec.service.replica_policy
        lo, _hi = spec.service.replica_bounds()
        if policy is None or not policy.autoscaled:
            return lo
        now = self.clock.now()
        report = self.load or LoadReport()
        queued = report.queued
        if self.last is not None and now - self._decided_at < self.interval and not queued:
            return self.last.target
        raw = self.store.get_policy_state(self.service, STATE_KEY)
        state = AutoscalerState.from_json(raw) if raw else initial_state(policy)
        inflight = sum(r.inflight for r in report.replicas.values())
        self.signals = signals or {}
        self.latency_ms = self.latency(policy)
        load = LoadObservation(
            self._pending, inflight, queued, signals=self.signals, latency_ms=self.latency_ms
        )
        decision = autoscale(policy, state, load, now, spec.accelerator())
        self._pending = 0
        self._decided_at = now
        self.last = decision
        self.store.put_policy_state(self.service, STATE_KEY, decision.state.to_json(), now)
        if decision.target != state.target:
            message = (
                f"autoscaler: target {state.target} -> {decision.target} "
                f"({decision.reason}; {decision.qps:.2f} req/s, {inflight} in flight)"
            )
            self.store.add_event(self.service, now, "autoscaler", message)
            log.info("service %s: %s", self.service, message)
        return decision.target
