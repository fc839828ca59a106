"""Autoscaling as pure functions: (policy, state, observation, now) -> (decision, new state).

The state is a value the controller persists after each decision, so a restarted controller
carries on with the same target, request window and delay timers (SkyServe keeps them in
memory: a restart falls back to min_replicas and can scale a loaded service down at once).

Delays are seconds of sustained demand, never loop ticks: the fleet grows only after the
demand has stayed above the current target for `upscale_delay_seconds`, and shrinks only after
it has stayed below for `downscale_delay_seconds`. From zero, the first request scales up at
once; to zero, only after a whole downscale delay without a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fleetserve.spec.models import ReplicaPolicy


@dataclass(frozen=True)
class LoadObservation:
    """What the load balancer reported this round."""

    new_requests: int  # requests since the previous observation
    inflight: int  # requests in flight now, all replicas together
    queued: int = 0  # requests held while nothing is ready (scale from zero)


@dataclass(frozen=True)
class AutoscalerState:
    target: int
    window: tuple[tuple[float, int], ...] = ()  # (second, requests), inside the QPS window
    above_since: float | None = None  # demand above target since (sustained upscale)
    below_since: float | None = None  # demand below target since (sustained downscale)
    last_request_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "window": [list(x) for x in self.window],
            "above_since": self.above_since,
            "below_since": self.below_since,
            "last_request_at": self.last_request_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AutoscalerState:
        return cls(
            target=int(d["target"]),
            window=tuple((float(t), int(n)) for t, n in d.get("window", [])),
            above_since=d.get("above_since"),
            below_since=d.get("below_since"),
            last_request_at=d.get("last_request_at"),
        )


@dataclass(frozen=True)
class Decision:
    target: int  # replicas wanted, num_overprovision included
    demand: int  # replicas the load needs now (clipped to min..max), before the delays
    qps: float
    inflight: int
    reason: str
    state: AutoscalerState = field(repr=False)


def initial_state(policy: ReplicaPolicy) -> AutoscalerState:
    return AutoscalerState(target=policy.min_replicas)


def per_replica_qps(policy: ReplicaPolicy, accelerator: str | None = None) -> float | None:
    """A replica's target QPS; per accelerator (instance-aware) it is the replica type's entry,
    or the smallest entry when the type is unknown (a conservative capacity)."""
    target = policy.target_qps_per_replica
    if target is None:
        return None
    if isinstance(target, dict):
        if accelerator is not None:
            for key, qps in target.items():
                if key.split(":")[0] == accelerator.split(":")[0]:
                    return qps
        return min(target.values())
    return float(target)


def needed_replicas(
    policy: ReplicaPolicy, qps: float, inflight: int, accelerator: str | None
) -> int:
    """Replicas the load needs, by request rate and by requests in flight (the larger)."""
    need = 0
    per_qps = per_replica_qps(policy, accelerator)
    if per_qps is not None:
        need = max(need, math.ceil(qps / per_qps - 1e-9))
    if policy.target_ongoing_requests_per_replica is not None:
        need = max(need, math.ceil(inflight / policy.target_ongoing_requests_per_replica - 1e-9))
    return need


def autoscale(
    policy: ReplicaPolicy,
    state: AutoscalerState,
    load: LoadObservation,
    now: float,
    accelerator: str | None = None,
) -> Decision:
    window_s = policy.qps_window_seconds
    second = float(math.floor(now))
    window = [(t, n) for t, n in state.window if t > now - window_s]
    if load.new_requests:
        if window and window[-1][0] == second:
            window[-1] = (second, window[-1][1] + load.new_requests)
        else:
            window.append((second, load.new_requests))
    qps = sum(n for _, n in window) / window_s
    asked = load.new_requests > 0 or load.queued > 0 or load.inflight > 0
    last_request_at = now if asked else state.last_request_at
    hi = policy.effective_max
    demand = min(
        max(needed_replicas(policy, qps, load.inflight, accelerator), policy.min_replicas), hi
    )
    current = max(state.target - (policy.num_overprovision or 0), 0)
    # The bounds are the policy's as it is now: an update that raised min_replicas or lowered
    # max_replicas applies at once, not after a scaling delay.
    current = min(max(current, policy.min_replicas), hi)
    if asked and demand == 0 and hi > 0:
        demand = 1  # a request is a reason for one replica, however low the rate
    if demand > 0 and current == 0 and load.queued > 0:
        # Scale from zero at the first request: nothing can answer it until a replica is up.
        new_current, above, below, reason = demand, None, None, "scale from zero: a request waits"
    elif demand > current:
        above = state.above_since if state.above_since is not None else now
        below = None
        if now - above >= policy.upscale_delay_seconds:
            new_current, above = demand, None
            reason = f"demand {demand} above {current} for {policy.upscale_delay_seconds:g} s"
        else:
            new_current, reason = (
                current,
                f"demand {demand} above {current} since {now - above:.0f} s",
            )
    elif demand < current:
        below = state.below_since if state.below_since is not None else now
        above = None
        idle = last_request_at is None or now - last_request_at >= policy.downscale_delay_seconds
        if demand == 0 and not idle:
            new_current, reason = current, "requests came within the downscale delay: not to zero"
        elif now - below >= policy.downscale_delay_seconds:
            new_current, below = demand, None
            reason = f"demand {demand} below {current} for {policy.downscale_delay_seconds:g} s"
        else:
            new_current, reason = (
                current,
                f"demand {demand} below {current} since {now - below:.0f} s",
            )
    else:
        new_current, above, below, reason = current, None, None, "steady"
    target = new_current + (policy.num_overprovision or 0) if new_current > 0 else 0
    new_state = AutoscalerState(
        target=target,
        window=tuple(window),
        above_since=above,
        below_since=below,
        last_request_at=last_request_at,
    )
    return Decision(target, demand, qps, load.inflight, reason, new_state)


@dataclass(frozen=True)
class FallbackTargets:
    spot: int
    on_demand: int


def fallback_targets(
    policy: ReplicaPolicy, target: int, ready_spot: int, uses_spot: bool
) -> FallbackTargets:
    """How many spot and on-demand replicas make up `target` (SkyServe's FallbackRequestRate):
    `base_ondemand_fallback_replicas` always on demand; with `dynamic_ondemand_fallback`, one
    more on demand for each spot replica that is wanted but not ready."""
    if not uses_spot:
        return FallbackTargets(spot=0, on_demand=target)
    base = min(policy.base_ondemand_fallback_replicas, target)
    spot = target - base
    extra = max(0, spot - ready_spot) if policy.dynamic_ondemand_fallback else 0
    return FallbackTargets(spot=spot, on_demand=min(base + extra, target))


def spot_split(
    policy: ReplicaPolicy, target: int, extra: int, basis: int, ready_spot: int
) -> FallbackTargets:
    """The spot and on-demand replicas a spot fleet wants: `target` READY ones plus `extra`
    spare spot ones, on-demand fallback counted against `basis` spot replicas (the placer's
    `fallback_basis`: SkyServe's counts the spares too), never more on demand than `target`.
    The controller and the simulator call this same rule."""
    split = fallback_targets(policy, target + extra, ready_spot, uses_spot=True)
    hedge = fallback_targets(policy, basis, ready_spot, uses_spot=True)
    return FallbackTargets(spot=split.spot, on_demand=min(hedge.on_demand, target))
