"""The last hour of a service, for the dashboard's charts: request rate, latency p50/p99,
in-flight requests and errors, for the service and for each replica, with the autoscaler's
target and the READY count beside them.

It is made from the load reports the controller already reads from the load balancer every
round: those carry counters that only grow (requests, errors, latency histogram buckets, per
replica), and two reports `step` seconds apart give rates and quantiles for that step, the way
Prometheus' rate() and histogram_quantile() do. Kept in memory, in rings bounded by `horizon /
step` points and `max_replicas` series: a restarted controller starts its charts anew, and a
service with a thousand replicas costs the same as one with `max_replicas`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fleetserve.core.histogram import quantile
from fleetserve.lb.messages import LoadReport, ReplicaTotals

SERVICE = 0  # the series key of the service as a whole (replica ids start at 1)


@dataclass(frozen=True)
class Point:
    """One step of one series. Traffic figures are None where no report covered the step
    (no load balancer yet, or it was restarting)."""

    at: float
    rps: float | None = None
    p50: float | None = None  # seconds
    p99: float | None = None
    inflight: int | None = None
    errors: float | None = None  # per second: 5xx answers and failed upstream attempts
    ready: int | None = None  # service series only
    target: int | None = None  # service series only
    version: int | None = None  # replica series only


@dataclass
class _Totals:
    requests: int = 0
    errors: int = 0
    latency: tuple[int, ...] = ()  # cumulative count per bound, +Inf last


def window_percentile_ms(
    prev: LoadReport | None, cur: LoadReport, q: float, first_byte: bool
) -> float | None:
    """The q-quantile (0 < q < 1), in milliseconds, of the requests the replicas answered
    between two load reports: of the time to first byte (`first_byte`) or of the whole
    response's duration, over all replicas (not the answers the load balancer made itself).
    From the deltas of the cumulative histograms; when a counter went down (a restarted load
    balancer, or one without these histograms before) or there is no earlier report, `cur`
    alone. None when no request was measured in between."""
    if not 0 < q < 1:
        raise ValueError(f"window_percentile_ms: q must be in (0, 1), got {q}")
    bounds = cur.latency_bounds
    size = len(bounds) + 1

    def counts(report: LoadReport) -> dict[str, list[int]]:
        out = {}
        for key, t in report.totals.items():
            hist = t.first_byte if first_byte else t.latency
            if key.isdigit() and len(hist) == size:  # empty: an older LB's, none kept
                out[key] = hist
        return out

    now = counts(cur)
    then = counts(prev) if prev is not None and prev.latency_bounds == bounds else {}
    if any(
        key not in now or any(c < b for c, b in zip(now[key], hist, strict=True))
        for key, hist in then.items()
    ):
        then = {}  # counters went down: a new load balancer (or worker) counting from zero
    window = [0] * size
    for key, hist in now.items():
        before = then.get(key)
        for i, c in enumerate(hist):
            window[i] += c - before[i] if before is not None else c
    value = quantile(bounds, window, q)
    return None if value is None else value * 1000.0


def _totals(raw: ReplicaTotals) -> _Totals:
    return _Totals(requests=raw.requests, errors=raw.errors, latency=tuple(raw.latency))


def _plus(a: _Totals, b: _Totals) -> _Totals:
    latency = a.latency or (0,) * len(b.latency)
    return _Totals(
        a.requests + b.requests,
        a.errors + b.errors,
        tuple(x + y for x, y in zip(latency, b.latency, strict=False)),
    )


def _step(
    now: _Totals, then: _Totals | None, seconds: float, bounds: Sequence[float]
) -> tuple[float, float, float | None, float | None]:
    """(requests/s, errors/s, p50, p99) between two reads of one series' counters. Counters
    that went down belong to a restarted load balancer: they count from zero."""
    if then is None or now.requests < then.requests or len(now.latency) != len(then.latency):
        then = _Totals(latency=tuple(0 for _ in now.latency))
    requests = now.requests - then.requests
    errors = max(0, now.errors - then.errors)
    delta = [a - b for a, b in zip(now.latency, then.latency, strict=True)]
    if any(d < 0 for d in delta):
        delta = list(now.latency)
    return (
        requests / seconds,
        errors / seconds,
        quantile(bounds, delta, 0.5),
        quantile(bounds, delta, 0.99),
    )


@dataclass
class History:
    """The rings of one service."""

    step: float = 5.0
    horizon: float = 3600.0
    max_replicas: int = 64
    series: dict[int, deque[Point]] = field(default_factory=dict)
    _last: dict[int, _Totals] = field(default_factory=dict)
    _last_at: float | None = None
    _seen: dict[int, float] = field(default_factory=dict)  # replica -> last step it was in

    @property
    def size(self) -> int:
        return max(2, math.ceil(self.horizon / self.step))

    def due(self, now: float) -> bool:
        """Whether `observe(now, ...)` would add a point."""
        return self._last_at is None or now - self._last_at >= self.step

    def observe(
        self,
        now: float,
        report: LoadReport | None,
        ready: int,
        target: int,
        versions: Mapping[int, int],
    ) -> bool:
        """Fold in this round's load report (None: none was read); a point is added once
        `step` seconds have passed since the last one. True when one was."""
        if not self.due(now):
            return False
        seconds = now - self._last_at if self._last_at is not None else self.step
        self._last_at = now
        service = Point(at=now, ready=ready, target=target)
        if report is not None:
            bounds = report.latency_bounds
            live = report.replicas
            inflight = {int(k): v.inflight for k, v in live.items() if k.isdigit()}
            new: dict[int, _Totals] = {}
            sums = _Totals()
            for key, raw in report.totals.items():
                rid = int(key) if key.isdigit() else -1  # -1: answered by the LB itself
                t = _totals(raw)
                sums = _plus(sums, t)
                new[rid] = t
                if rid in versions:  # a replica still on the books (not one long gone)
                    rps, errs, p50, p99 = _step(t, self._last.get(rid), seconds, bounds)
                    self._add(
                        rid,
                        Point(
                            now, rps, p50, p99, inflight.get(rid, 0), errs, version=versions[rid]
                        ),
                    )
            for rid, count in inflight.items():  # in flight, not answered yet
                if rid not in new and rid in versions:
                    self._add(rid, Point(now, 0.0, None, None, count, 0.0, version=versions[rid]))
            rps, errs, p50, p99 = _step(sums, self._last.get(SERVICE), seconds, bounds)
            service = Point(now, rps, p50, p99, sum(inflight.values()), errs, ready, target)
            new[SERVICE] = sums
            self._last = new
        self._add(SERVICE, service)
        self._forget(now)
        return True

    def _add(self, key: int, point: Point) -> None:
        ring = self.series.get(key)
        if ring is None:
            ring = self.series[key] = deque(maxlen=self.size)
        ring.append(point)
        self._seen[key] = point.at

    def _forget(self, now: float) -> None:
        """Replicas with no point in the horizon go; past `max_replicas`, the longest quiet."""
        replicas = sorted((at, key) for key, at in self._seen.items() if key != SERVICE)
        over = len(replicas) - self.max_replicas
        for i, (at, key) in enumerate(replicas):
            if i < over or now - at > self.horizon:
                self.series.pop(key, None)
                self._seen.pop(key, None)

    def since(self, after: float | None) -> dict[int, list[Point]]:
        """Every series' points later than `after` (all of them with None)."""
        return {
            key: [p for p in ring if after is None or p.at > after]
            for key, ring in self.series.items()
        }
