"""`Scaler`: the fleet's target size, from the load balancer's load reports through the pure
autoscaler (fleetserve.policies.autoscaler), with the autoscaler's state persisted after each
decision so that a restarted controller carries on where it stopped."""

from __future__ import annotations

import logging

from fleetserve.core.clock import Clock
from fleetserve.lb.messages import LoadReport
from fleetserve.policies.autoscaler import (
    AutoscalerState,
    Decision,
    LoadObservation,
    autoscale,
    initial_state,
)
from fleetserve.spec.models import ServiceTask
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

    def inflight_of(self, replica_id: int) -> int:
        replica = self.load.replicas.get(str(replica_id)) if self.load is not None else None
        return replica.inflight if replica is not None else 0

    def observe(self, report: LoadReport | None) -> None:
        if report is None:
            return
        self.load = report
        total = report.total_requests
        if self._last_total is not None:
            # A restarted load balancer counts from zero again.
            self._pending += total - self._last_total if total >= self._last_total else total
        self._last_total = total

    def target(self, spec: ServiceTask) -> int:
        """Replicas wanted now: min_replicas for a fixed fleet, else the autoscaler's."""
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
        decision = autoscale(
            policy, state, LoadObservation(self._pending, inflight, queued), now, spec.accelerator()
        )
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
