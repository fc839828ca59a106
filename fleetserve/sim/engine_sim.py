"""Replay a request-rate trace through autoscaling policies on a fleet of LLM engine models.

Each second of the trace, requests arrive as a Poisson process at the trace's rate (a seeded
generator: every policy sees the same requests), with prompt and output lengths drawn from a
seeded log-normal `Workload`. The load balancer sends each to the READY replica with the
fewest requests in flight (held while none is READY); each replica is an engine model
(fleetserve.sim.engine). Every second the autoscaler (the controller's own code,
fleetserve.policies.autoscaler) gets what the controller gives it: the requests of that
second, the requests in flight, those held, the replicas' engine signals (waiting requests,
running requests, KV cache usage) as read every `metrics_scrape_seconds`, and the time to
first token at the policy's percentile over the last `qps_window_seconds`, interpolated in the
load balancer's histogram buckets as the controller does. A launched replica is billed from
its launch and serves after `cold_start`; one removed drains (no new requests, billed until
its last request ends), or goes at once if it was not READY yet. With `move_waiting` the load
balancer also moves waiting requests to READY replicas with none waiting at each reading of
the replicas' metrics, as `load_balancer.move_waiting_requests` does (`plan_moves`).

`calibrate` derives every policy's target from the engine model alone, by one rule, so that
no target is tuned to a trace: the capacity of one replica is the highest steady request
rate at which its TTFT at the percentile meets the TTFT target; each signal's target is its
mean on one replica at `UTILIZATION` of that capacity.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetserve.core.histogram import quantile
from fleetserve.lb.metrics import LATENCY_BUCKETS
from fleetserve.lb.mover import plan_moves as lb_plan_moves
from fleetserve.policies.autoscaler import (
    AutoscalerState,
    LoadObservation,
    SignalReading,
    autoscale,
)
from fleetserve.sim.engine import EngineConfig, Replica, Request
from fleetserve.sim.simulator import Trace
from fleetserve.spec.models import ReplicaPolicy

UTILIZATION = 0.8  # the signals' targets: their means at this share of a replica's capacity
# Each steady run of the calibration: 2 h of requests (1,800 s gave capacities 0.96-1.25 req/s
# over 4 seeds with the defaults; 7,200 s gave 1.08-1.14).
CALIBRATION_SECONDS = 7200.0
MAX_REQUESTS = 2_000_000  # a longer run is refused (about a minute per policy)
TAIL_SECONDS = 1800.0  # after the trace: time for the requests still in the fleet to finish
READ_TIMEOUT = 600.0  # load_balancer.read_timeout_seconds' default: no first byte, given up
QUEUE_TIMEOUT = 300.0  # load_balancer.queue_timeout_seconds' default: held, given up
POLICIES = ("request_rate", "in_flight", "queue", "kv_cache", "ttft")


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths in tokens: log-normal around their medians, capped. The
    defaults are an illustrative chat mix (a few hundred tokens of prompt and of reply)."""

    prompt_median: float = 600.0
    prompt_sigma: float = 0.8
    output_median: float = 150.0
    output_sigma: float = 0.8
    max_prompt: int = 4096
    max_output: int = 1024

    def __post_init__(self) -> None:
        if not (self.prompt_median >= 1 and self.output_median >= 1):
            raise ValueError("prompt and output medians must be >= 1 token")
        if not (0 <= self.prompt_sigma <= 3 and 0 <= self.output_sigma <= 3):
            raise ValueError("sigmas must be in [0, 3]")
        if self.max_prompt < 1 or self.max_output < 1:
            raise ValueError("max_prompt and max_output must be >= 1")

    def draw(self, rng: random.Random) -> tuple[int, int]:
        p = rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma)
        o = rng.lognormvariate(math.log(self.output_median), self.output_sigma)
        return max(1, min(self.max_prompt, round(p))), max(1, min(self.max_output, round(o)))


def check_fits(engine: EngineConfig, workload: Workload) -> None:
    """The longest request must fit in an empty engine's KV cache, or it would wait forever."""
    if workload.max_prompt + workload.max_output > engine.kv_tokens:
        raise ValueError(
            f"max_prompt + max_output ({workload.max_prompt} + {workload.max_output}) must "
            f"fit in kv_tokens ({engine.kv_tokens})"
        )


class Arrivals:
    """The requests of each second, in order: a Poisson process at the trace's rate, lengths
    from the workload; one generator per run, seeded, so that each policy gets the same ones."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self.workload = workload
        self.rng = random.Random(seed)

    def second(self, t: float, rate: float, length: float = 1.0) -> list[Request]:
        out: list[Request] = []
        if rate <= 0:
            return out
        at = t + self.rng.expovariate(rate)
        while at < t + length:
            prompt, output = self.workload.draw(self.rng)
            out.append(Request(at, prompt, output))
            at += self.rng.expovariate(rate)
        return out


@dataclass
class _Node:
    replica: Replica
    launched: float
    ready_at: float
    draining: bool = False


@dataclass
class EngineRun:
    policy: str
    ttfts: list[float] = field(default_factory=list)  # seconds, sorted at the end
    requests: int = 0
    over_target: int = 0  # TTFT above the target, or no first token at all by the end
    timed_out: int = 0  # given up waiting: the LB's read (or queue) timeout
    unserved: int = 0  # no first token by the end: timed out, or still in the fleet
    replica_seconds: float = 0.0
    max_replicas: int = 0
    scale_events: int = 0
    moved: int = 0  # waiting requests the load balancer moved (move_waiting)
    times: list[float] = field(default_factory=list)
    qps: list[float] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600

    @property
    def over_target_share(self) -> float:
        return self.over_target / self.requests if self.requests else 0.0

    def ttft_percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the TTFTs, in seconds (nearest rank)."""
        if not self.ttfts:
            return None
        i = min(len(self.ttfts) - 1, max(0, math.ceil(q / 100 * len(self.ttfts)) - 1))
        return self.ttfts[i]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class _LatencyWindow:
    """The TTFTs of the requests whose first token came in the window, counted in the load
    balancer's histogram buckets (LATENCY_BUCKETS), so that latency_ms is the percentile the
    controller would compute from the LB's time-to-first-byte histogram."""

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()  # (when, bucket index)
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)

    def add(self, when: float, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # the first bound >= it (le)
        self.entries.append((when, i))
        self.counts[i] += 1

    def drop_until(self, until: float) -> None:
        while self.entries and self.entries[0][0] <= until:
            self.counts[self.entries.popleft()[1]] -= 1

    def percentile_ms(self, q: float) -> float | None:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        value = quantile(LATENCY_BUCKETS, cumulative, q / 100)
        return None if value is None else value * 1000.0


def _reading(
    values: list[float], ready: int, pairs: list[tuple[float, float]] | None = None
) -> SignalReading:
    if not values:
        return SignalReading(mean=None, peak=None, answered=0, ready=ready)
    return SignalReading(
        mean=sum(values) / len(values),
        peak=max(values),
        answered=len(values),
        ready=ready,
        pairs=tuple(pairs or ()),
    )


def plan_moves(readings: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The load balancer's moves of waiting requests (`move_waiting_requests`) at one reading
    of the READY replicas' metrics: `readings` are their (running, waiting) requests; the
    moves are (from, to) indexes into it. The LB's own plan (fleetserve.lb.mover.plan_moves),
    the indexes as replica ids: ties go to the first (the oldest replica)."""
    queues = dict(enumerate(readings))
    return lb_plan_moves(queues, queues.keys(), limit=sum(w for _, w in readings))


def move_waiting(replicas: Sequence[Replica], now: float) -> list[tuple[Request, int, int]]:
    """Read the READY `replicas` and carry out `plan_moves` at `now`: each move takes the
    source's newest waiting request that was never moved to the end of the target's waiting
    queue. A planned move whose source has no such request left (its waiting ones were all
    moved there) is not made, as the load balancer's. Returns (request, from, to) per move."""
    plan = plan_moves([(r.running, r.queued) for r in replicas])
    done: list[tuple[Request, int, int]] = []
    for i, j in plan:
        request = replicas[i].take_newest_waiting()
        if request is not None:
            replicas[j].receive_moved(request, now)
            done.append((request, i, j))
    return done


def expected_requests(trace: Trace) -> float:
    return sum(trace.qps) * trace.step


def run_engine_fleet(
    trace: Trace,
    policy: ReplicaPolicy,
    name: str,
    engine: EngineConfig,
    workload: Workload,
    ttft_target: float,
    cold_start: float = 60.0,
    seed: int = 0,
    tail: float = TAIL_SECONDS,
    read_timeout: float = READ_TIMEOUT,
    queue_timeout: float = QUEUE_TIMEOUT,
    move: bool = False,
) -> EngineRun:
    """Run one policy over the trace; `ttft_target` (seconds) is what counts a request as
    over target. A request waiting in an engine longer than `read_timeout`, or held by the
    load balancer (nothing READY) longer than `queue_timeout`, is given up (as the LB's
    timeouts of those names do): it counts as over target. With `move`, the load balancer
    moves waiting requests at each reading of the replicas (`move_waiting`); a moved request's
    read timeout starts again at its move (the LB sends it again)."""
    if expected_requests(trace) > MAX_REQUESTS:
        raise ValueError(
            f"{trace.name}: about {expected_requests(trace):,.0f} requests, more than the "
            f"engine model's bound of {MAX_REQUESTS:,}: use --duration or --scale"
        )
    check_fits(engine, workload)
    run = EngineRun(name)
    arrivals = Arrivals(workload, seed)
    state = AutoscalerState(target=policy.min_replicas)
    nodes: list[_Node] = [
        _Node(Replica(engine), -cold_start, 0.0) for _ in range(policy.min_replicas)
    ]
    held: deque[Request] = deque()  # at the load balancer while nothing is READY
    window = _LatencyWindow()  # the TTFTs of the last qps_window_seconds, for latency_ms
    wants_latency = (
        getattr(policy, "target_ttft_ms", None) is not None
        or getattr(policy, "target_latency_ms", None) is not None
    )
    percentile = float(getattr(policy, "latency_percentile", 90.0))
    scrape = float(getattr(policy, "metrics_scrape_seconds", 5.0))
    latency_window = policy.qps_window_seconds
    signals: dict[str, SignalReading] = {}
    next_scrape = 0.0
    target = policy.min_replicas
    t = 0.0
    end = trace.seconds
    while t < end or (t < end + tail and (held or any(n.replica.load for n in nodes))):
        rate = trace.at(t) if t < end else 0.0
        new = arrivals.second(t, rate)
        while held and held[0].arrived < t - queue_timeout:
            held.popleft()
            run.timed_out += 1
        run.requests += len(new)
        ready = [n for n in nodes if not n.draining and n.ready_at <= t]
        if ready:
            sent: dict[int, list[Request]] = {}
            loads = [n.replica.load for n in ready]
            for req in (*held, *new):
                i = loads.index(min(loads))
                loads[i] += 1
                sent.setdefault(i, []).append(req)
            held.clear()
            for i, rs in sent.items():
                ready[i].replica.incoming.extend(rs)
        else:
            held.extend(new)
        now = t + 1.0
        for n in nodes:
            if n.ready_at <= t or n.draining:
                engine_of = n.replica
                run.timed_out += engine_of.expire(t - read_timeout)
                engine_of.advance(now)
                first, _ = engine_of.take_events()
                for req in first:
                    ttft = req.ttft
                    assert ttft is not None
                    run.ttfts.append(ttft)
                    if wants_latency:
                        window.add(now, ttft)
        nodes = [n for n in nodes if not (n.draining and n.replica.load == 0)]
        window.drop_until(now - latency_window)
        ready = [n for n in nodes if not n.draining and n.ready_at <= now]
        if now >= next_scrape:
            next_scrape = now + scrape
            signals = {
                "queue": _reading([float(n.replica.queued) for n in ready], len(ready)),
                "running": _reading(
                    [float(n.replica.running) for n in ready],
                    len(ready),
                    [(float(n.replica.running), float(n.replica.queued)) for n in ready],
                ),
                "kv_cache": _reading([n.replica.kv_usage for n in ready], len(ready)),
            }
            if move and len(ready) > 1:  # the same reading, by the load balancer
                run.moved += len(move_waiting([n.replica for n in ready], now))
        latency_ms = window.percentile_ms(percentile) if wants_latency else None
        # As the controller's: in flight at the replicas (draining ones too), held apart.
        inflight = sum(n.replica.load for n in nodes)
        decision = autoscale(
            policy,
            state,
            LoadObservation(len(new), inflight, len(held), signals=signals, latency_ms=latency_ms),
            now,
        )
        state = decision.state
        if decision.target != target:
            run.scale_events += 1
            target = decision.target
        _resize(nodes, target, now, engine, cold_start)
        if t < end:
            run.replica_seconds += len(nodes)
            run.max_replicas = max(run.max_replicas, len(nodes))
            run.times.append(t)
            run.qps.append(rate)
            run.ready.append(len(ready))
        t = now
    run.ttfts.sort()
    run.unserved = run.requests - len(run.ttfts)
    run.over_target = run.unserved + (len(run.ttfts) - bisect.bisect_right(run.ttfts, ttft_target))
    return run


def _resize(nodes: list[_Node], target: int, now: float, engine: EngineConfig, cold: float) -> None:
    serving = [n for n in nodes if not n.draining]
    for _ in range(target - len(serving)):
        nodes.append(_Node(Replica(engine, now=now + cold), now, now + cold))
    extra = len(serving) - target
    if extra <= 0:
        return
    # As the controller: those not READY first (gone at once), then the newest, drained.
    order = sorted(serving, key=lambda n: (n.ready_at <= now, -n.launched))
    for n in order[:extra]:
        if n.ready_at > now:
            nodes.remove(n)
        else:
            n.draining = True


@dataclass(frozen=True)
class Calibration:
    """One replica's capacity under the TTFT target and each signal's value at UTILIZATION
    of it: the targets of every policy, by one rule."""

    capacity_qps: float  # the highest steady rate with TTFT at the percentile <= target
    utilization: float  # the share of it the targets are taken at
    qps: float  # utilization x capacity: request_rate's target
    inflight: float  # mean requests in flight at that rate: in_flight's target
    queue: float  # mean waiting requests: the engine-queue target
    kv_cache: float  # mean KV cache usage: the KV-cache target
    ttft_ms: float  # the TTFT target itself: the TTFT policy's target


def _steady(
    engine: EngineConfig, workload: Workload, rate: float, seconds: float, seed: int
) -> tuple[list[float], list[tuple[int, int, float]], int]:
    """One replica, always ready, at a steady Poisson rate: its TTFTs (after a warm-up of a
    tenth of the run), its (in flight, waiting, KV usage) each second, and the requests left
    unfinished at the end."""
    arrivals = Arrivals(workload, seed)
    replica = Replica(engine)
    ttfts: list[float] = []
    samples: list[tuple[int, int, float]] = []
    warm = seconds / 10
    t = 0.0
    while t < seconds:
        replica.incoming.extend(arrivals.second(t, rate))
        replica.advance(t + 1)
        first, _ = replica.take_events()
        if t >= warm:
            ttfts.extend(r.ttft for r in first if r.ttft is not None)
            samples.append((replica.load, replica.queued, replica.kv_usage))
        t += 1
    return ttfts, samples, replica.load


def calibrate(
    engine: EngineConfig,
    workload: Workload,
    ttft_target_ms: float,
    percentile: float = 90.0,
    seed: int = 0,
    seconds: float = CALIBRATION_SECONDS,
    utilization: float = UTILIZATION,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """The targets by the rule: the capacity by bisection on steady runs of one replica,
    then each signal's mean at `utilization` of it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--utilization must be in (0, 1], got {utilization:g}")
    check_fits(engine, workload)

    def meets(rate: float) -> bool:
        ttfts, _, left = _steady(engine, workload, rate, seconds, seed)
        if not ttfts:
            return True
        return _percentile(ttfts, percentile) * 1000 <= ttft_target_ms and left < rate * 60

    lo, hi = 0.0, 0.125
    while meets(hi):
        lo, hi = hi, hi * 2
        if hi > 1e5:
            raise ValueError("the engine model serves more than 100,000 req/s: check it")
    if lo == 0.0:
        # Even a trickle misses the target (one request's prefill alone takes longer).
        probe = hi
        while probe > 1e-3 and not meets(probe):
            probe /= 2
        if probe <= 1e-3:
            raise ValueError(
                f"the TTFT target {ttft_target_ms:g} ms is not met at any request rate: "
                "one request's prefill takes longer; raise it"
            )
        lo, hi = probe, probe * 2
    for _ in range(8):
        mid = (lo + hi) / 2
        if progress is not None:
            progress(f"capacity between {lo:.3g} and {hi:.3g} req/s")
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    capacity = lo
    rate = utilization * capacity
    _, samples, _ = _steady(engine, workload, rate, 2 * seconds, seed + 1)
    n = len(samples)
    return Calibration(
        capacity_qps=capacity,
        utilization=utilization,
        qps=rate,
        inflight=sum(s[0] for s in samples) / n,
        queue=sum(s[1] for s in samples) / n,
        kv_cache=sum(s[2] for s in samples) / n,
        ttft_ms=ttft_target_ms,
    )


def engine_policy(
    name: str,
    cal: Calibration,
    min_replicas: int,
    max_replicas: int,
    upscale_delay: float,
    downscale_delay: float,
    window: float,
    percentile: float = 90.0,
    given: float | None = None,
) -> ReplicaPolicy:
    """The policy `name` with its target from the calibration (a target that the rule
    puts below 0.01 is 0.01: the spec's keys are positive), or the `given` one."""
    common: dict[str, object] = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "upscale_delay_seconds": upscale_delay,
        "downscale_delay_seconds": downscale_delay,
        "qps_window_seconds": window,
    }
    keys: dict[str, dict[str, object]] = {
        "request_rate": {"target_qps_per_replica": round(cal.qps, 4)},
        "in_flight": {"target_ongoing_requests_per_replica": round(max(cal.inflight, 0.01), 4)},
        "queue": {"target_queue_per_replica": round(max(cal.queue, 0.01), 4)},
        "kv_cache": {"target_kv_cache_usage": round(min(max(cal.kv_cache, 0.01), 1.0), 4)},
        "ttft": {"target_ttft_ms": cal.ttft_ms, "latency_percentile": percentile},
    }
    if name not in keys:
        raise ValueError(f"unknown policy {name!r}: use {', '.join(POLICIES)}")
    chosen = keys[name]
    if given is not None:
        key = next(iter(chosen))
        chosen = {**chosen, key: given}
    return ReplicaPolicy.model_validate({**common, **chosen})


def target_text(name: str, policy: ReplicaPolicy) -> str:
    """The policy's target as its replica_policy key says it."""
    key = {
        "request_rate": "target_qps_per_replica",
        "in_flight": "target_ongoing_requests_per_replica",
        "queue": "target_queue_per_replica",
        "kv_cache": "target_kv_cache_usage",
        "ttft": "target_ttft_ms",
    }[name]
    return f"{key}: {getattr(policy, key):.4g}"
