"""The load balancer's signals: Prometheus metrics and the load report for autoscaling.

The load report is bounded whatever the traffic: per replica, request counts in one-second
buckets over a sliding window (never a list of timestamps, unlike SkyServe's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetserve.lb.messages import LoadReport, ReplicaLoad, ReplicaTotals

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Rejection(StrEnum):
    """Why the load balancer refused a request or closed a connection to protect itself
    (the `reason` label of fleetserve_lb_rejected_total)."""

    BAD_REQUEST = "bad_request"  # 400: malformed, ambiguous framing (smuggling), no Host
    HTTP_VERSION = "http_version"  # 505: neither HTTP/1.0 nor HTTP/1.1
    HEADER_BYTES = "header_bytes"  # 431
    HEADER_COUNT = "header_count"  # 431
    URL_BYTES = "url_bytes"  # 414
    PIPELINED = "pipelined"  # 429: more requests queued on one connection than allowed
    CONNECTIONS = "connections"  # 503 and close: the process holds its connection limit
    CLIENT_CONNECTIONS = "client_connections"  # 503 and close: max_connections_per_client
    HEADER_TIMEOUT = "header_timeout"  # 408 (or a silent close before any byte)
    IDLE_TIMEOUT = "idle_timeout"  # a keep-alive connection closed silently


class Metrics:
    def __init__(self, service: str, policy: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["service", "policy", "replica"]
        self.requests = Counter(
            "fleetserve_lb_requests",
            "Requests answered, by replica and status code (replica 'none': answered by the LB).",
            [*labels, "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "fleetserve_lb_request_duration_seconds",
            "Time from request to the end of the response.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "fleetserve_lb_time_to_first_byte_seconds",
            "Time from sending a request to a replica to the first byte of its answer's "
            "body (for a streaming LLM server: time to first token; the head, which such a "
            "server sends at once, does not count); of a retried request, the attempt that "
            "was answered.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "fleetserve_lb_inflight_requests",
            "Requests in flight to each replica.",
            labels,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "fleetserve_lb_upstream_errors",
            "Failures talking to a replica (refused, reset, timeout).",
            [*labels, "kind"],
            registry=self.registry,
        )
        self._moved = Counter(
            "fleetserve_lb_requests_moved",
            "move_waiting_requests: requests moved from a replica's queue to a replica with "
            "room, by the replica they left.",
            labels,
            registry=self.registry,
        )
        self.queued = Gauge(
            "fleetserve_lb_queued_requests",
            "Requests held while no replica is ready.",
            ["service"],
            registry=self.registry,
        )
        rejected = Counter(
            "fleetserve_lb_rejected",
            "Requests refused and connections closed by the load balancer to protect itself.",
            ["service", "reason"],
            registry=self.registry,
        )
        # Every reason shows from the start (at 0), and a hit costs no label lookup.
        self._rejected = {r: rejected.labels(service, r.value) for r in Rejection}
        prompt_blocks = Counter(
            "fleetserve_lb_prompt_blocks",
            "cache_aware: prompt blocks routed, and those matched in the chosen replica's "
            "prefix index (matched / routed: the expected prefix-cache hit rate).",
            ["service", "kind"],
            registry=self.registry,
        )
        self._routed_blocks = prompt_blocks.labels(service, "routed")
        self._matched_blocks = prompt_blocks.labels(service, "matched")
        self._extra_load = Gauge(
            "fleetserve_lb_choice_extra_load_max",
            "cache_aware: the most requests in flight a chosen replica had beyond the least "
            "loaded one, since the load balancer started (below max_extra_load by design).",
            ["service"],
            registry=self.registry,
        ).labels(service)
        self._extra_load_max = 0
        self.reported_load = Gauge(
            "fleetserve_lb_replica_reported_load",
            "cache_aware with replica_metrics_seconds: the running + waiting requests each "
            "replica's own /metrics reported at the last read (absent: no answer or no such "
            "metric, then the LB's in-flight count stands).",
            ["service", "replica"],
            registry=self.registry,
        )
        self._reported: dict[int, int] | None = None  # the poller's live dict, when one runs
        self.queued_blocks = Gauge(
            "fleetserve_lb_replica_queued_prompt_blocks",
            "cache_aware (cost): prompt blocks sent to each replica whose streamed answer has "
            "not begun (the prefill the LB counts as queued there; read at scrape time).",
            ["service", "replica"],
            registry=self.registry,
        )
        self._queued_blocks: dict[int, int] | None = None  # the ReplicaSet's live dict
        precise_tokens = Counter(
            "fleetserve_lb_precise_prompt_tokens",
            "cache_aware's precise mode: prompt tokens of the requests placed with the engines' "
            "KV cache events (`prompt`), and the most of them one replica's engine held "
            "(`matched`; matched / prompt: the hit rate the events promised).",
            ["service", "kind"],
            registry=self.registry,
        )
        self._precise_prompt = precise_tokens.labels(service, "prompt")
        self._precise_matched = precise_tokens.labels(service, "matched")
        self.service = service
        self.policy = policy
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def done(
        self, replica: str, code: int, seconds: float, first_byte: float | None = None
    ) -> None:
        """One request answered: its status, its duration and, when a replica answered, the
        time to the first byte of that answer."""
        key = (replica, code)
        children = self._children.get(key)
        if children is None:  # label lookups are the costly part: once per (replica, code)
            children = (
                self.requests.labels(self.service, self.policy, replica, str(code)),
                self.latency.labels(self.service, self.policy, replica),
                # The LB's own answers ('none') have no first byte: no such series.
                None
                if replica == "none"
                else self.first_byte.labels(self.service, self.policy, replica),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if first_byte is not None and children[2] is not None:
            children[2].observe(first_byte)

    def prompt_blocks(self, matched: int, routed: int, extra_load: int) -> None:
        self._routed_blocks.inc(routed)
        self._matched_blocks.inc(matched)
        if extra_load > self._extra_load_max:
            self._extra_load_max = extra_load
            self._extra_load.set(extra_load)

    def precise_tokens(self, matched: int, prompt: int) -> None:
        self._precise_prompt.inc(prompt)
        self._precise_matched.inc(matched)

    def moved(self, source: int, target: int) -> None:
        self._moved.labels(self.service, self.policy, str(source)).inc()

    def error(self, replica: str, kind: str) -> None:
        self.upstream_errors.labels(self.service, self.policy, replica, kind).inc()

    def rejected(self, reason: Rejection) -> None:
        self._rejected[reason].inc()

    def sync_inflight(self, inflight: dict[int, int], routable: set[int]) -> None:
        """Set the in-flight gauges from the live counts (at scrape time, off the hot path)."""
        self.inflight.clear()
        for rid in routable | set(inflight):
            self.inflight.labels(self.service, self.policy, str(rid)).set(inflight.get(rid, 0))
        if self._queued_blocks is not None:
            self.queued_blocks.clear()
            blocks = self._queued_blocks
            for rid in routable | set(blocks):
                self.queued_blocks.labels(self.service, str(rid)).set(blocks.get(rid, 0))
        if self._reported is not None:
            self.reported_load.clear()
            for rid, load in list(self._reported.items()):
                self.reported_load.labels(self.service, str(rid)).set(load)

    def watch_queued_blocks(self, blocks: dict[int, int]) -> None:
        """Export these counts (ReplicaSet.prefilling, this process's) per replica."""
        self._queued_blocks = blocks

    def watch_reported(self, reported: dict[int, int]) -> None:
        """Export the replicas' reported loads (this dict, kept by the metrics poller)."""
        self._reported = reported

    def set_queued(self, value: int) -> None:
        self.queued.labels(self.service).set(value)

    def totals(self) -> dict[str, ReplicaTotals]:
        """Per replica ('none': answered by the LB itself), counted since this process
        started: requests, errors (5xx answers and failed upstream attempts), the latency and
        time-to-first-byte histograms (cumulative per bound of LATENCY_BUCKETS, +Inf last).
        Read off the metrics
        at report time, not on the request path; the controller turns two reports into rates
        and quantiles (fleetserve.controller.history)."""
        out: dict[str, ReplicaTotals] = {}
        index = {float(b): i for i, b in enumerate(LATENCY_BUCKETS)}

        def slot(replica: str) -> ReplicaTotals:
            entry = out.get(replica)
            if entry is None:
                size = len(LATENCY_BUCKETS) + 1
                entry = out[replica] = ReplicaTotals(latency=[0] * size, first_byte=[0] * size)
            return entry

        for family in self.requests.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    entry = slot(s.labels["replica"])
                    entry.requests += int(s.value)
                    if s.labels["code"].startswith("5"):
                        entry.errors += int(s.value)
        for family in self.upstream_errors.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    slot(s.labels["replica"]).errors += int(s.value)
        for histogram, first_byte in ((self.latency, False), (self.first_byte, True)):
            for family in histogram.collect():
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        le = s.labels["le"]
                        i = len(LATENCY_BUCKETS) if le == "+Inf" else index.get(float(le))
                        if i is not None:
                            entry = slot(s.labels["replica"])
                            (entry.first_byte if first_byte else entry.latency)[i] = int(s.value)
        return out


@dataclass
class _Buckets:
    counts: deque[tuple[int, int]] = field(default_factory=deque)  # (second, count)

    def add(self, second: int) -> None:
        if self.counts and self.counts[-1][0] == second:
            self.counts[-1] = (second, self.counts[-1][1] + 1)
        else:
            self.counts.append((second, 1))

    def total(self, since: int) -> int:
        while self.counts and self.counts[0][0] < since:
            self.counts.popleft()
        return sum(c for _, c in self.counts)


class LoadTracker:
    """Request counts per replica (and for requests no replica took) over a sliding window."""

    def __init__(self, window_seconds: int = 60, clock: Callable[[], float] = time.time) -> None:
        self.window = window_seconds
        self.clock = clock
        self._per_key: dict[str, _Buckets] = {}
        self.total = 0

    def record(self, key: str) -> None:
        self._per_key.setdefault(key, _Buckets()).add(int(self.clock()))
        self.total += 1

    def report(self, inflight: dict[int, int], queued: int) -> LoadReport:
        now = int(self.clock())
        since = now - self.window + 1
        rates = {k: b.total(since) / self.window for k, b in self._per_key.items()}
        for k in [k for k, b in self._per_key.items() if not b.counts]:
            del self._per_key[k]
        return LoadReport(
            at=self.clock(),
            window_seconds=self.window,
            latency_bounds=list(LATENCY_BUCKETS),
            requests_per_second=sum(rates.values()),
            total_requests=self.total,
            queued=queued,
            replicas={
                str(rid): ReplicaLoad(
                    inflight=inflight.get(rid, 0),
                    requests_per_second=rates.get(str(rid), 0.0),
                )
                for rid in sorted(set(inflight) | {int(k) for k in rates if k.isdigit()})
            },
        )


def load_report(
    load: LoadTracker, metrics: Metrics, inflight: dict[int, int], queued: int
) -> LoadReport:
    """What the controller reads at /-/load: the sliding-window rates that the autoscaler
    uses, and the counters that the dashboard's charts are made of."""
    report = load.report(inflight, queued)
    report.totals = metrics.totals()
    return report
