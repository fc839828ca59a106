"""Autoscaling as pure functions: (policy, state, observation, now) -> (decision, new state).

The state is a value the controller persists after each decision, so a restarted controller
carries on with the same target, request window and delay timers (SkyServe keeps them in
memory: a restart falls back to min_replicas and can scale a loaded service down at once).

Delays are seconds of sustained demand, never loop ticks: the fleet grows only after the
demand has stayed above the current target for `upscale_delay_seconds`, and shrinks only after
it has stayed below for `downscale_delay_seconds`. From zero, the first request scales up at
once; to zero, only after a whole downscale delay without a request.

Demand is the largest of what each configured signal asks for: the request rate, requests in
flight, what the replicas report (engine queue, KV cache use, any gauge) and the latency the
load balancer measures. A replica-reported signal that no replica answered holds the current
size: a replica that does not answer is never read as an idle one.

The engine queue is a saturation signal: a queue is 0 until a replica is saturated, so it
says when to grow, never how far the fleet can shrink. It grows the fleet while the waiting
requests stay above their target, and shrinks it only when the replicas' running requests
would fit in fewer replicas below the concurrency at which their queue reaches its target
(the queue's onset), learnt from what the replicas reported: a bounded curve of the mean
queue by running requests per replica, kept in the persisted state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetserve.spec.models import MetricTarget, ReplicaPolicy

QUEUE = "queue"
RUNNING = "running"  # requests running in the engines: read with the queue, same scrape
KV_CACHE = "kv_cache"
# The engine queue shrinks the fleet only to where the running requests per replica stay
# under QUEUE_FIT x the queue's onset: the margin for the load to grow while a replica starts.
QUEUE_FIT = 0.8
# The onset curve: mean queue per replica by running requests per replica, in buckets of
# CURVE_STEPS per doubling (at most CURVE_BUCKETS of them), each observation's weight decaying
# by CURVE_DECAY per decision (a time constant of about 3 h of decisions once a second); a
# bucket counts once it holds CURVE_MIN_WEIGHT observations (one replica at one decision).
CURVE_STEPS = 4
CURVE_BUCKETS = 64
CURVE_DECAY = 0.9999
CURVE_MIN_WEIGHT = 120.0
CURVE_DROP = 0.01
# The engine queue and the running requests are read as their fleet totals averaged over the
# last QUEUE_SMOOTH_SECONDS (exponentially weighted): a queue that comes and goes between two
# steps of a saturated engine otherwise drops under its target for a moment and restarts the
# upscale delay, and the fleet grows late or never (bench/autoscale/README.md, run F). KEDA
# setups read vLLM's queue over a window too (avg_over_time). A reading older than
# QUEUE_SMOOTH_RESET x that (a controller restart, no replica answering) is not averaged with.
QUEUE_SMOOTH_SECONDS = 10.0
QUEUE_SMOOTH_RESET = 6.0
# The latency rule's band: shrink only below LATENCY_LOW x target, and only when one replica
# fewer is predicted (latency x n / (n - 1)) to stay under LATENCY_PREDICTED x target.
LATENCY_LOW = 0.5
LATENCY_PREDICTED = 0.8


def metric_key(index: int) -> str:
    """The `LoadObservation.signals` key of `target_metrics[index]`."""
    return f"metric:{index}"


@dataclass(frozen=True)
class SignalReading:
    """One replica-reported signal this round, over the READY replicas."""

    mean: float | None  # mean over the replicas that answered; None: none answered
    peak: float | None  # max over those
    answered: int  # replicas whose value was read
    ready: int  # READY replicas asked
    # RUNNING only: (running, waiting) of each replica that reported both, for the queue's
    # onset (a mean over the fleet would mix a backlogged replica with a new idle one).
    pairs: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class LoadObservation:
    """What the load balancer (and the replicas) reported this round."""

    new_requests: int  # requests since the previous observation
    inflight: int  # requests in flight now, all replicas together
    queued: int = 0  # requests held while nothing is ready (scale from zero)
    # keys: QUEUE, KV_CACHE, metric_key(i) (index into target_metrics)
    signals: Mapping[str, SignalReading] = field(default_factory=dict)
    # The LB-measured percentile over the last window; None: no request measured.
    latency_ms: float | None = None


@dataclass(frozen=True)
class AutoscalerState:
    target: int
    window: tuple[tuple[float, int], ...] = ()  # (second, requests), inside the QPS window
    above_since: float | None = None  # demand above target since (sustained upscale)
    below_since: float | None = None  # demand below target since (sustained downscale)
    last_request_at: float | None = None
    # The engine queue's onset curve: (bucket, weight, mean running, mean queue) per replica,
    # by bucket; at most CURVE_BUCKETS entries (empty unless target_queue_per_replica is set).
    queue_curve: tuple[tuple[int, float, float, float], ...] = ()
    # The engine queue's smoothed fleet totals: (when, waiting, running; -1: not read).
    queue_smooth: tuple[float, float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.target,
            "window": [list(x) for x in self.window],
            "above_since": self.above_since,
            "below_since": self.below_since,
            "last_request_at": self.last_request_at,
        }
        if self.queue_curve:
            out["queue_curve"] = [list(x) for x in self.queue_curve]
        if self.queue_smooth is not None:
            out["queue_smooth"] = list(self.queue_smooth)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AutoscalerState:
        return cls(
            target=int(d["target"]),
            window=tuple((float(t), int(n)) for t, n in d.get("window", [])),
            above_since=d.get("above_since"),
            below_since=d.get("below_since"),
            last_request_at=d.get("last_request_at"),
            queue_curve=tuple(
                (int(b), float(w), float(r), float(q))
                for b, w, r, q in d.get("queue_curve", [])[:CURVE_BUCKETS]
            ),
            queue_smooth=_smooth_from_json(d.get("queue_smooth")),
        )


def _smooth_from_json(value: Any) -> tuple[float, float, float] | None:
    """A stored queue_smooth, or None when it is not three finite numbers (a state written by
    an older fleetserve, or damaged: the next reading starts it again)."""
    if not isinstance(value, list) or len(value) != 3:
        return None
    try:
        t, q, r = (float(x) for x in value)
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(x) for x in (t, q, r)) or not 0 <= q <= 1e7 or not -1 <= r <= 1e7:
        return None
    return t, q, r


@dataclass(frozen=True)
class Decision:
    target: int  # replicas wanted, num_overprovision included
    demand: int  # replicas the load needs now (clipped to min..max), before the delays
    qps: float
    inflight: int
    reason: str
    state: AutoscalerState = field(repr=False)
    # Which signal set the demand, and its value, e.g. "engine queue 7.5/replica, target 2".
    signal: str = ""


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


def _metric_label(m: MetricTarget) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(m.labels.items()))
    return f"{m.name}{{{labels}}}" if labels else m.name


def _proportional(
    name: str,
    reading: SignalReading | None,
    target: float,
    peak: bool,
    current: int,
    show: Callable[[float], str],
    unit: str = "",
) -> tuple[int, str]:
    """Replicas a replica-reported signal asks for: enough that each carries `target`, the
    replicas that did not answer counted as the mean of those that did. No answer: hold."""
    if reading is None or reading.answered == 0 or reading.mean is None:
        asked = 0 if reading is None else reading.ready
        return current, f"{name}: no replica answered (0 of {asked}), holding {current}"
    value = reading.peak if peak and reading.peak is not None else reading.mean
    need = math.ceil(reading.ready * value / target - 1e-9) if reading.ready else current
    part = (
        f" ({reading.answered} of {reading.ready} replicas answered)"
        if reading.answered < reading.ready
        else ""
    )
    return max(need, 0), f"{name} {show(value)}{unit}{part}, target {show(target)}"


Curve = tuple[tuple[int, float, float, float], ...]


def _bucket(running: float) -> int:
    return min(CURVE_BUCKETS - 1, round(CURVE_STEPS * math.log2(1 + running)))


def learn_queue_curve(curve: Curve, pairs: Iterable[tuple[float, float]]) -> Curve:
    """The onset curve with one decision's observations more (each replica's running and
    waiting requests), the older ones decayed: at most CURVE_BUCKETS buckets, those of no
    weight left out."""
    table = {k: [w * CURVE_DECAY, r, q] for k, w, r, q in curve}
    for running, waiting in pairs:
        if not (math.isfinite(running) and math.isfinite(waiting)) or running < 0 or waiting < 0:
            continue
        entry = table.setdefault(_bucket(running), [0.0, 0.0, 0.0])
        w = entry[0] + 1.0
        entry[1] += (running - entry[1]) / w
        entry[2] += (waiting - entry[2]) / w
        entry[0] = w
    return tuple((k, w, r, q) for k, (w, r, q) in sorted(table.items()) if w >= CURVE_DROP)[
        :CURVE_BUCKETS
    ]


def queue_onset(curve: Curve, target: float) -> float | None:
    """The running requests per replica at which the mean queue reaches `target`: the mean
    running of the lowest bucket with CURVE_MIN_WEIGHT observations whose mean queue is at or
    above it (else of the bucket with the most observations among those at or above it, while
    they are few); None: the queue never reached its target. At least 1."""
    over = [(k, w, r) for k, w, r, q in curve if q >= target]
    if not over:
        return None
    firm = [r for k, w, r in over if w >= CURVE_MIN_WEIGHT]
    onset = firm[0] if firm else max(over, key=lambda x: x[1])[2]
    return max(onset, 1.0)


def _queue(
    queue: SignalReading | None,
    running: SignalReading | None,
    target: float,
    onset: float | None,
    current: int,
) -> tuple[int, str]:
    """Replicas the engine queue asks for. Above its target, and more requests in the engines
    (running and waiting) than the replicas run at the onset: enough replicas that each runs
    no more than the onset (a wait at replicas that run fewer is an arrival between two of
    their steps, not saturation). Otherwise: the fewest replicas whose running requests stay
    under QUEUE_FIT x the onset, never more than now. Without a running reading, or before the
    queue ever reached its target: the queue's own proportional rule."""
    if queue is None or queue.answered == 0 or queue.mean is None:
        asked = 0 if queue is None else queue.ready
        return current, f"engine queue: no replica answered (0 of {asked}), holding {current}"
    n = queue.ready
    q = queue.mean
    part = f" ({queue.answered} of {n} replicas answered)" if queue.answered < n else ""
    text = f"engine queue {q:.3g}/replica{part}, target {target:.3g}"
    r = running.mean if running is not None and running.answered else None
    if r is None or n == 0:
        need = math.ceil(n * q / target - 1e-9) if n else current
        return max(need, 0), text
    if q > target and onset is None:
        # It queues for the first time with nothing learnt: the running count it queued at.
        if r <= 0:
            return max(math.ceil(n * q / target - 1e-9), n + 1), text
        need = max(n + 1, math.ceil(n * (r + q) / r - 1e-9))
        return need, f"{text}; {r:.3g} running/replica"
    if onset is None:
        return max(math.ceil(n * q / target - 1e-9), 0), f"{text}; no queue onset seen yet"
    if q > target:
        need = math.ceil(n * (r + q) / onset - 1e-9)
        if need > n:
            return need, f"{text}; {r:.3g} running/replica, queue onset {onset:.3g}"
    fit = math.ceil(n * r / (QUEUE_FIT * onset) - 1e-9)
    return min(max(fit, 0), n), (
        f"{text}; {r:.3g} running/replica, fits {fit} at {QUEUE_FIT:g} x queue onset {onset:.3g}"
    )


def _latency(policy: ReplicaPolicy, load: LoadObservation, current: int) -> tuple[int, str] | None:
    target = policy.latency_target_ms
    if target is None:
        return None
    what = f"p{policy.latency_percentile:g} {'TTFT' if policy.target_ttft_ms else 'latency'}"
    latency = load.latency_ms
    if latency is None:
        if load.inflight > 0:
            # Requests running, none ended in the window: no news is not good news.
            return current, f"{what}: no request ended in the window, holding {current}"
        return None
    text = f"{what} {latency:.0f} ms, target {target:g} ms"
    if latency > target:
        up = max(current + 1, math.ceil(current * latency / target - 1e-9))
        return min(up, max(2 * current, 1)), text
    if (
        latency < LATENCY_LOW * target
        and current > 1
        and latency * current / (current - 1) < LATENCY_PREDICTED * target
    ):
        return current - 1, text
    return current, text


def smooth_queue(
    smooth: tuple[float, float, float] | None, signals: Mapping[str, SignalReading], now: float
) -> tuple[tuple[float, float, float] | None, dict[str, SignalReading] | None]:
    """The engine queue's and running requests' fleet totals averaged over about
    QUEUE_SMOOTH_SECONDS (QUEUE_SMOOTH_SECONDS above): the new smoothed state, and the
    signals with their per-replica means replaced by the smoothed totals over the READY
    replicas (None: no queue read this round, nothing replaced; the state holds).

    A fleet total is each round's mean over the replicas that answered times the READY
    replicas (as the rules read it: one that did not answer counts as the mean of those that
    did). Totals, not means: a new idle replica does not halve a backlog that stays where it
    is. An average within half a request (or 1%) of the round's reading is that reading (an
    exponential average only nears it, and a rule's ceiling at a boundary would hold one
    replica more for minutes).
    A running count not read this round is forgotten, not held: it starts again when read."""
    queue, running = signals.get(QUEUE), signals.get(RUNNING)
    if queue is None or not queue.answered or queue.mean is None or not queue.ready:
        return smooth, None
    waiting = queue.mean * queue.ready
    run_now = (
        running.mean * running.ready
        if running is not None and running.answered and running.mean is not None and running.ready
        else None
    )
    if smooth is None or not 0 <= now - smooth[0] <= QUEUE_SMOOTH_RESET * QUEUE_SMOOTH_SECONDS:
        q, r = waiting, -1.0 if run_now is None else run_now
    else:
        a = 1.0 - math.exp(-(now - smooth[0]) / QUEUE_SMOOTH_SECONDS)
        q = _toward(smooth[1], waiting, a)
        if run_now is None:
            r = -1.0
        else:
            r = run_now if smooth[2] < 0 else _toward(smooth[2], run_now, a)
    out = dict(signals)
    out[QUEUE] = replace(queue, mean=q / queue.ready)
    if running is not None and r >= 0:
        out[RUNNING] = replace(running, mean=r / running.ready)
    return (now, q, r), out


def _toward(old: float, new: float, a: float) -> float:
    value = old + a * (new - old)
    return new if abs(value - new) <= max(0.5, 0.01 * new) else value


def signal_demands(
    policy: ReplicaPolicy,
    load: LoadObservation,
    qps: float,
    current: int,
    accelerator: str | None = None,
    onset: float | None = None,
) -> list[tuple[int, str]]:
    """What each configured signal asks for (replicas, and what it read), in the policy's
    order: request rate, in flight, engine queue, KV cache, target_metrics, latency.
    `onset`: the running requests per replica at which the engine queue reaches its
    target, as learnt (`queue_onset()` of the state's curve)."""
    out: list[tuple[int, str]] = []
    per_qps = per_replica_qps(policy, accelerator)
    if per_qps is not None:
        out.append(
            (
                math.ceil(qps / per_qps - 1e-9),
                f"request rate {qps:.2f} req/s, target {per_qps:g}/replica",
            )
        )
    per_inflight = policy.target_ongoing_requests_per_replica
    if per_inflight is not None:
        out.append(
            (
                math.ceil(load.inflight / per_inflight - 1e-9),
                f"{load.inflight} in flight, target {per_inflight:g}/replica",
            )
        )
    signals = load.signals
    if policy.target_queue_per_replica is not None:
        out.append(
            _queue(
                signals.get(QUEUE),
                signals.get(RUNNING),
                policy.target_queue_per_replica,
                onset,
                current,
            )
        )
    if policy.target_kv_cache_usage is not None:
        out.append(
            _proportional(
                "KV cache use",
                signals.get(KV_CACHE),
                policy.target_kv_cache_usage,
                False,
                current,
                lambda v: f"{100 * v:.0f}%",
            )
        )
    for i, m in enumerate(policy.target_metrics or ()):
        peak = m.aggregation == "max"
        out.append(
            _proportional(
                f"{_metric_label(m)} ({'max' if peak else 'mean'})",
                signals.get(metric_key(i)),
                m.target,
                peak,
                current,
                lambda v: f"{v:.4g}",
            )
        )
    latency = _latency(policy, load, current)
    if latency is not None:
        out.append(latency)
    return out


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
    current = max(state.target - (policy.num_overprovision or 0), 0)
    # The bounds are the policy's as it is now: an update that raised min_replicas or lowered
    # max_replicas applies at once, not after a scaling delay.
    current = min(max(current, policy.min_replicas), hi)
    curve = state.queue_curve
    onset = None
    smooth = state.queue_smooth
    if policy.target_queue_per_replica is not None:
        running = load.signals.get(RUNNING)
        if running is not None and running.pairs:
            curve = learn_queue_curve(curve, running.pairs)
        onset = queue_onset(curve, policy.target_queue_per_replica)
        smooth, smoothed = smooth_queue(smooth, load.signals, now)
        if smoothed is not None:
            load = replace(load, signals=smoothed)
    needs = signal_demands(policy, load, qps, current, accelerator, onset)
    # The largest need names the signal; on a tie a signal that was read beats one that holds.
    need, signal = max(needs, key=lambda x: (x[0], "holding" not in x[1])) if needs else (0, "")
    demand = min(max(need, policy.min_replicas), hi)
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
            reason = (
                f"{signal}: demand {demand} above {current} for {policy.upscale_delay_seconds:g} s"
            )
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
            reason = (
                f"{signal}: demand {demand} below {current} "
                f"for {policy.downscale_delay_seconds:g} s"
            )
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
        queue_curve=curve,
        queue_smooth=smooth,
    )
    return Decision(target, demand, qps, load.inflight, reason, new_state, signal)


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
