"""How many replicas the fleet needs before autoscaling exists: `min_replicas`, except that a
service that may scale to zero (min_replicas 0) keeps one replica while it has had a request
within its downscale delay. A held request (the LB's wake-up) counts as a request."""

from __future__ import annotations


def fleet_target(
    min_replicas: int,
    max_replicas: int,
    last_request_at: float | None,
    now: float,
    idle_seconds: float,
) -> int:
    if min_replicas > 0 or max_replicas == 0:
        return min_replicas
    if last_request_at is not None and now - last_request_at < idle_seconds:
        return 1
    return 0
