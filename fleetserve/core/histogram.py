"""Quantiles of histograms in Prometheus' form (cumulative counts per upper bound, +Inf
last): the controller reads the load balancer's this way (fleetserve.controller.history), and
the simulator reads its own the same way (fleetserve.sim.engine_sim)."""

from __future__ import annotations

from collections.abc import Sequence


def quantile(bounds: Sequence[float], cumulative: Sequence[int], q: float) -> float | None:
    """The q-quantile of a histogram step (cumulative counts per upper bound, +Inf last),
    interpolated linearly inside its bucket; None with no observation. One that falls in
    the +Inf bucket is the largest finite bound (as Prometheus answers)."""
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    below, lower = 0, 0.0
    for i, count in enumerate(cumulative):
        if count >= rank:
            if i >= len(bounds):
                return float(bounds[-1]) if bounds else None
            upper = float(bounds[i])
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        below = count
        lower = float(bounds[i]) if i < len(bounds) else lower
    return float(bounds[-1]) if bounds else None
