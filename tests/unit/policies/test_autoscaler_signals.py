"""The autoscaler on what the replicas report (engine queue, KV cache, any gauge) and on the
latency the load balancer measures, on a fake clock: each signal, missing and partial
answers, the latency band, the delays, the state's round trip."""

from __future__ import annotations

import json

import pytest

import fleetserve.policies.autoscaler as A
from fleetserve.core.clock import FakeClock
from fleetserve.policies.autoscaler import (
    CURVE_BUCKETS,
    KV_CACHE,
    QUEUE,
    RUNNING,
    AutoscalerState,
    Decision,
    LoadObservation,
    SignalReading,
    autoscale,
    learn_queue_curve,
    metric_key,
    queue_onset,
)
from fleetserve.spec.models import ReplicaPolicy


def policy(**kw: object) -> ReplicaPolicy:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 10,
        "upscale_delay_seconds": 10,
        "downscale_delay_seconds": 30,
    }
    base.update(kw)
    return ReplicaPolicy.model_validate(base)


def reading(*values: float | None) -> SignalReading:
    """The reading of READY replicas that reported `values` (None: did not answer)."""
    got = [v for v in values if v is not None]
    return SignalReading(
        mean=sum(got) / len(got) if got else None,
        peak=max(got) if got else None,
        answered=len(got),
        ready=len(values),
    )


def run(
    p: ReplicaPolicy,
    state: AutoscalerState,
    clock: FakeClock,
    seconds: int,
    signals: dict[str, SignalReading] | None = None,
    latency_ms: float | None = None,
    inflight: int = 0,
) -> tuple[list[int], Decision]:
    """One decision a second for `seconds`; the targets seen and the last decision."""
    targets = []
    d: Decision | None = None
    for _ in range(seconds):
        clock.advance(1)
        load = LoadObservation(0, inflight, signals=signals or {}, latency_ms=latency_ms)
        d = autoscale(p, state, load, clock.now())
        state = d.state
        targets.append(d.target)
    assert d is not None
    return targets, d


@pytest.mark.parametrize(
    ("kw", "signals", "current", "demand", "shown"),
    [
        # 2 replicas, 7.5 waiting each, 2 per replica wanted: 15 / 2 -> 8
        ({"target_queue_per_replica": 2}, {QUEUE: reading(7, 8)}, 2, 8, "engine queue 7.5/replica"),
        ({"target_queue_per_replica": 2}, {QUEUE: reading(0, 1)}, 4, 1, "engine queue 0.5/replica"),
        ({"target_kv_cache_usage": 0.8}, {KV_CACHE: reading(0.9, 0.9)}, 2, 3, "KV cache use 90%"),
        ({"target_kv_cache_usage": 0.8}, {KV_CACHE: reading(0.1, 0.3)}, 3, 1, "KV cache use 20%"),
        (
            {"target_metrics": [{"name": "gpu:busy", "labels": {"gpu": "0"}, "target": 10}]},
            {metric_key(0): reading(20, 10, 30)},
            3,
            6,
            'gpu:busy{gpu="0"} (mean) 20',
        ),
        (
            {"target_metrics": [{"name": "gpu_busy", "target": 10, "aggregation": "max"}]},
            {metric_key(0): reading(5, 5, 30)},  # the busiest replica is held to the target
            3,
            9,
            "gpu_busy (max) 30",
        ),
        (
            # two metrics: the larger need wins and is named
            {
                "target_metrics": [
                    {"name": "a", "target": 10},
                    {"name": "b", "target": 1},
                ]
            },
            {metric_key(0): reading(10, 10), metric_key(1): reading(2, 2)},
            2,
            4,
            "b (mean) 2",
        ),
        # partial answers: the silent replica counts as the mean of those that answered
        ({"target_queue_per_replica": 2}, {QUEUE: reading(4, None, None)}, 3, 6, "1 of 3"),
        # request rate (none) vs queue: the queue names the demand
        (
            {"target_qps_per_replica": 5, "target_queue_per_replica": 1},
            {QUEUE: reading(3, 3)},
            2,
            6,
            "engine queue 3/replica",
        ),
    ],
)
def test_each_signal_sets_the_demand_and_names_itself(
    kw: dict[str, object],
    signals: dict[str, SignalReading],
    current: int,
    demand: int,
    shown: str,
) -> None:
    p = policy(**kw)
    d = autoscale(p, AutoscalerState(target=current), LoadObservation(0, 0, signals=signals), 5.0)
    assert d.demand == demand
    assert shown in d.signal, d.signal


@pytest.mark.parametrize(
    "signals",
    [
        {},  # the controller has no reading at all
        {QUEUE: reading(None, None, None)},  # no replica answered
        {QUEUE: SignalReading(None, None, 0, 0)},  # no replica READY
    ],
)
def test_a_missing_signal_never_shrinks_nor_grows_the_fleet(
    signals: dict[str, SignalReading],
) -> None:
    p = policy(target_queue_per_replica=2, min_replicas=0)
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=3), clock, 300, signals)
    assert set(targets) == {3}
    assert d.demand == 3 and "no replica answered" in d.signal


def test_a_missing_signal_does_not_hold_back_another_one() -> None:
    p = policy(target_queue_per_replica=2, target_kv_cache_usage=0.5)
    clock = FakeClock(100.0)
    signals = {QUEUE: reading(None, None), KV_CACHE: reading(1.0, 1.0)}
    targets, d = run(p, AutoscalerState(target=2), clock, 12, signals)
    assert targets[-1] == 4 and "KV cache use 100%" in d.signal


def test_without_an_answer_a_replica_reported_zero_is_still_zero() -> None:
    """The other side: replicas that answer 0 do let the fleet shrink, after the delay."""
    p = policy(target_queue_per_replica=2)
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=3), clock, 31, {QUEUE: reading(0, 0, 0)})
    assert targets[:29] == [3] * 29 and targets[-1] == 1
    assert "engine queue 0/replica, target 2: demand 1 below 3 for 30 s" in d.reason


def test_delays_apply_to_replica_signals() -> None:
    p = policy(target_queue_per_replica=2)
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=1), clock, 20, {QUEUE: reading(0)})
    # a queue of 6 for 5 s (read over QUEUE_SMOOTH_SECONDS: above the target of 2 after
    # about 4 s), then none: shorter than the upscale delay, nothing changes
    targets, d = run(p, d.state, clock, 5, {QUEUE: reading(6)})
    assert set(targets) == {1} and "above 1 since" in d.reason
    targets, d = run(p, d.state, clock, 30, {QUEUE: reading(0)})
    assert set(targets) == {1} and "above" not in d.reason
    # one that stays: above the target after about 4 s, scaled 10 s later
    targets, d = run(p, d.state, clock, 30, {QUEUE: reading(6)})
    assert targets[-1] == 3 and 12 <= targets.index(3) <= 16, targets
    assert d.state.queue_smooth is not None and d.state.queue_smooth[1] == pytest.approx(6, 0.1)


def test_a_queue_that_comes_and_goes_is_read_over_a_few_seconds() -> None:
    """A saturated engine whose queue empties for a moment between steps (6 waiting, then 0,
    every other 2 s; 3 on average, over the target of 2): read as it was read before
    2026-12-05, each empty moment restarted the upscale delay and the fleet never grew; read
    over QUEUE_SMOOTH_SECONDS it grows after the delay. A brief dip does not restart it."""
    p = policy(target_queue_per_replica=2)
    clock = FakeClock(100.0)
    state = AutoscalerState(target=1)
    targets = []
    for second in range(40):
        clock.advance(1)
        waiting = 6.0 if second % 4 < 2 else 0.0
        d = autoscale(
            p, state, LoadObservation(0, 6, signals={QUEUE: reading(waiting)}), clock.now()
        )
        state = d.state
        targets.append(d.target)
    assert targets[0] == 1 and 1 < targets[-1] <= 3
    grew = targets.index(targets[-1])
    assert 10 <= grew <= 25, targets
    # a one-second dip to 1 in a queue of 6 does not restart the delay
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=1), clock, 5, {QUEUE: reading(6)})
    targets2, d = run(p, d.state, clock, 1, {QUEUE: reading(1)})
    targets3, d = run(p, d.state, clock, 5, {QUEUE: reading(6)})
    assert targets3[-1] == 3 and (targets + targets2 + targets3).index(3) == 10


def test_the_smoothed_queue_is_of_the_fleet_not_of_a_replica() -> None:
    """A backlog of 12 on one replica stays where it is when a second, idle one joins: the
    fleet's smoothed total does not halve with the count of replicas; a reading with no
    answer leaves it as it was; a damaged stored value starts it again."""
    state = AutoscalerState(target=1)
    smooth, out = A.smooth_queue(None, {QUEUE: reading(12)}, 10.0)
    assert smooth == (10.0, 12.0, -1.0) and out is not None and out[QUEUE].mean == 12
    smooth, out = A.smooth_queue(smooth, {QUEUE: reading(12, 0)}, 11.0)
    assert out is not None and out[QUEUE].mean == pytest.approx(6.0)  # 12 over 2 replicas
    assert A.smooth_queue(smooth, {QUEUE: reading(None, None)}, 12.0) == (smooth, None)
    # a reading long after the last one (a restart) is not averaged with it
    assert A.smooth_queue(smooth, {QUEUE: reading(0, 0)}, 1000.0)[0] == (1000.0, 0.0, -1.0)
    for bad in ([1, 2], ["x", 1, 2], [float("nan"), 1, 2], [1, -5, 0], [1, 1e308, 0], "x", None):
        restored = AutoscalerState.from_json({**state.to_json(), "queue_smooth": bad})
        assert restored.queue_smooth is None


@pytest.mark.parametrize(
    ("current", "latency", "demand"),
    [
        (2, 900.0, 4),  # above: proportional (2 x 900/500 -> 4)
        (2, 501.0, 3),  # just above: one more
        (3, 5000.0, 6),  # far above: at most twice the fleet
        (1, 5000.0, 2),
        (2, 400.0, 2),  # inside the band: hold
        (2, 260.0, 2),  # above half the target: hold
        (2, 200.0, 2),  # below half, but one replica would be at 400 = 0.8 x target: hold
        (2, 150.0, 1),  # 1 replica predicted at 300 < 400: one fewer
        (4, 100.0, 3),  # one step at a time
        (1, 10.0, 1),  # never to zero on latency
    ],
)
def test_latency_rule_and_its_band(current: int, latency: float, demand: int) -> None:
    p = policy(target_ttft_ms=500, latency_percentile=95)
    d = autoscale(
        p, AutoscalerState(target=current), LoadObservation(0, 1, latency_ms=latency), 5.0
    )
    assert d.demand == demand
    assert f"p95 TTFT {latency:.0f} ms, target 500 ms" in d.signal


def test_latency_held_above_target_scales_up_after_the_delay_and_back_down() -> None:
    p = policy(target_latency_ms=1000)
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=1), clock, 11, latency_ms=2500, inflight=3)
    assert targets[:9] == [1] * 9 and targets[-1] == 2
    assert "p90 latency 2500 ms, target 1000 ms" in d.reason
    # well below: one fewer after the downscale delay
    targets, d = run(p, d.state, clock, 31, latency_ms=100, inflight=3)
    assert targets[:29] == [2] * 29 and targets[-1] == 1


def test_latency_without_a_measurement() -> None:
    p = policy(target_ttft_ms=500)
    clock = FakeClock(100.0)
    # requests in flight, none ended: hold
    targets, d = run(p, AutoscalerState(target=3), clock, 60, latency_ms=None, inflight=2)
    assert set(targets) == {3} and "no request ended" in d.signal
    # idle: the idle logic decides (min_replicas after the delay)
    targets, d = run(p, d.state, clock, 31, latency_ms=None, inflight=0)
    assert targets[-1] == 1


def test_state_round_trips_mid_delay() -> None:
    """A controller restarted between two decisions carries on with the same timers."""
    p = policy(target_queue_per_replica=2, target_ttft_ms=500)
    clock = FakeClock(100.0)
    signals = {QUEUE: reading(6, 6)}
    _, d = run(p, AutoscalerState(target=2), clock, 6, signals)
    restored = AutoscalerState.from_json(json.loads(json.dumps(d.state.to_json())))
    assert restored == d.state
    a, _ = run(p, d.state, FakeClock(clock.now()), 6, signals)
    b, _ = run(p, restored, FakeClock(clock.now()), 6, signals)
    assert a == b and a[-1] == 6 and a[0] == 2


def test_skyserve_keys_alone_are_unchanged() -> None:
    """Without the new keys the decision and its numbers are as before; the signal names
    the request rate."""
    p = policy(target_qps_per_replica=2, qps_window_seconds=10)
    clock = FakeClock(100.0)
    state = AutoscalerState(target=1)
    for _ in range(20):
        clock.advance(1)
        d = autoscale(p, state, LoadObservation(new_requests=6, inflight=0), clock.now())
        state = d.state
    assert d.target == 3 and d.demand == 3
    assert d.signal.startswith("request rate 6.00 req/s, target 2/replica")


# -- the engine queue as a saturation signal ----------------------------------------------------


def engines(running: list[float], waiting: list[float]) -> dict[str, SignalReading]:
    """The queue and running readings of replicas that each reported (running, waiting)."""
    return {
        QUEUE: reading(*waiting),
        RUNNING: SignalReading(
            mean=sum(running) / len(running),
            peak=max(running),
            answered=len(running),
            ready=len(running),
            pairs=tuple(zip(running, waiting, strict=True)),
        ),
    }


def saturating(load: float, n: int, limit: float = 10.0) -> dict[str, SignalReading]:
    """`n` replicas sharing `load` requests evenly, each running at most `limit` (its batch
    is full past that: the rest wait)."""
    each = load / n
    return engines([min(each, limit)] * n, [max(each - limit, 0.0)] * n)


def onset_state(target: int, onset: float = 10.0) -> AutoscalerState:
    """A fleet that has learnt that its replicas queue past `onset` running requests."""
    curve = learn_queue_curve((), [(onset / 2, 0.0)] * 200 + [(onset, 3.0)] * 200)
    return AutoscalerState(target=target, queue_curve=curve)


def test_the_queue_onset_is_learnt_per_replica_from_running_and_waiting() -> None:
    # A backlogged replica next to a new idle one: the fleet's means (5 running, 20 waiting)
    # would put the onset at 5; per replica it is where the queue forms (10).
    curve = learn_queue_curve((), [(10.0, 40.0), (0.0, 0.0)] * 150)
    assert queue_onset(curve, 1.0) == pytest.approx(10.0)
    # a moment's wait at low load (1 of 100 reads) is under the target: not the onset
    curve = learn_queue_curve(curve, [(3.0, 1.0)] + [(3.0, 0.0)] * 99)
    assert queue_onset(curve, 1.0) == pytest.approx(10.0)
    assert queue_onset(curve, 100.0) is None  # the queue never reached that target
    # bounded, whatever it is fed; old observations fade
    for i in range(500):
        curve = learn_queue_curve(curve, [(float(i * 37 % 100_000), 1.0)])
    assert len(curve) <= CURVE_BUCKETS
    assert (
        AutoscalerState.from_json(
            json.loads(json.dumps(AutoscalerState(target=1, queue_curve=curve).to_json()))
        ).queue_curve
        == curve
    )


def test_no_shrink_while_the_running_requests_would_saturate_one_replica_fewer() -> None:
    """3 replicas, 7 running each, none waiting: 21 on 2 replicas would be 10.5 each, past
    0.8 x the onset (10): the queue holds 3 however long it stays empty."""
    p = policy(target_queue_per_replica=1)
    clock = FakeClock(100.0)
    targets, d = run(p, onset_state(3), clock, 300, engines([7, 7, 7], [0, 0, 0]))
    assert set(targets) == {3} and d.demand == 3
    assert "engine queue 0/replica" in d.signal and "fits 3 at 0.8 x queue onset 10" in d.signal
    # the same empty queue without the running requests (a server that does not export
    # them) falls back to the queue's own rule: it shrinks
    targets, _ = run(p, onset_state(3), FakeClock(100.0), 31, {QUEUE: reading(0, 0, 0)})
    assert targets[-1] == 1


def test_shrink_when_the_running_requests_fit_fewer_replicas() -> None:
    p = policy(target_queue_per_replica=1)
    clock = FakeClock(100.0)
    # 15 running on 3 replicas: 2 run 7.5 each, under 8: down to 2 after the delay
    targets, d = run(p, onset_state(3), clock, 31, engines([5, 5, 5], [0, 0, 0]))
    assert targets[:29] == [3] * 29 and targets[-1] == 2
    assert d.reason.startswith("engine queue 0/replica, target 1; 5 running/replica, fits 2")
    assert d.reason.endswith("demand 2 below 3 for 30 s")
    # a replica that does not answer still counts as the mean of those that did
    targets, d = run(p, onset_state(3), FakeClock(100.0), 31, engines([5, 5], [0, 0]))
    assert targets[-1] == 2
    # no replica answers: hold
    targets, _ = run(p, onset_state(3), FakeClock(100.0), 100, {QUEUE: reading(None, None)})
    assert set(targets) == {3}


def test_up_on_the_queue_sizes_the_fleet_for_the_waiting_requests_at_the_onset() -> None:
    p = policy(target_queue_per_replica=1)
    # 2 replicas, 10 running and 6 waiting each: 32 requests at 10 a replica -> 4
    d = autoscale(p, onset_state(2), LoadObservation(0, 32, signals=saturating(32, 2)), 5.0)
    assert d.demand == 4 and "queue onset 10" in d.signal
    # the first time it queues, nothing learnt yet: the running count it queued at
    fresh = AutoscalerState(target=1)
    d = autoscale(p, fresh, LoadObservation(0, 30, signals=saturating(30, 1, 12)), 5.0)
    assert d.demand == 3 and d.state.queue_curve  # 30 at 12 a replica; and it learnt


def test_a_wait_below_the_onset_is_no_saturation_and_does_not_hold_the_fleet() -> None:
    """A request that arrived between two steps of a replica running 4 (onset 10) waits a
    moment: the queue's mean is over its target (0.05) every few seconds, yet the fleet is
    oversized (36 running fit 5 replicas at 8): it shrinks after the delay."""
    p = policy(target_queue_per_replica=0.05)
    clock = FakeClock(100.0)
    state = onset_state(9)
    targets = []
    for second in range(31):
        clock.advance(1)
        waiting = [1.0 if second % 5 == 0 else 0.0] + [0.0] * 8
        load = LoadObservation(0, 36, signals=engines([4.0] * 9, waiting))
        d = autoscale(p, state, load, clock.now())
        state = d.state
        targets.append(d.target)
    assert targets[:29] == [9] * 29 and targets[-1] == 5
    assert "fits 5 at 0.8 x queue onset 10" in d.reason


def _burst(p: ReplicaPolicy, with_running: bool) -> list[int]:
    """A fleet whose replicas are READY as soon as wanted, under 25 requests for 20 minutes
    then 4: the targets it went through."""
    clock = FakeClock(0.0)
    state = AutoscalerState(target=1)
    changes = [1]
    for second in range(1800):
        clock.advance(1)
        load = 25.0 if second < 1200 else 4.0
        signals = saturating(load, state.target)
        if not with_running:
            signals = {QUEUE: signals[QUEUE]}
        d = autoscale(p, state, LoadObservation(0, int(load), signals=signals), clock.now())
        if d.target != state.target:
            changes.append(d.target)
        state = d.state
    return changes


def test_no_oscillation_on_a_burst() -> None:
    """The queue alone shrinks the fleet whenever nothing waits (25 requests on 3 replicas
    of 10 each: none waits), then queues again; with the running requests read, the fleet
    grows once, holds while the burst lasts and shrinks once after it."""
    p = policy(target_queue_per_replica=1)
    legacy = _burst(p, with_running=False)
    assert len(legacy) > 10  # up, down to 1, up again ... for as long as the burst lasts
    assert _burst(p, with_running=True) == [1, 3, 1]


def test_replicas_that_do_not_answer_count_as_those_that_did_in_the_average() -> None:
    """4 READY replicas with 2 waiting each (target 2: demand 4); then 2 of them miss a
    scrape (timed out under load) for a minute: the others' mean stands for them, as in an
    instant's reading; the smoothed fleet total does not count the missing ones twice."""
    p = policy(target_queue_per_replica=2, upscale_delay_seconds=60)
    clock = FakeClock(100.0)
    targets, d = run(p, AutoscalerState(target=4), clock, 30, {QUEUE: reading(2, 2, 2, 2)})
    targets, d = run(p, d.state, clock, 90, {QUEUE: reading(2, 2, None, None)})
    assert set(targets) == {4} and d.demand == 4
    assert "engine queue 2/replica (2 of 4 replicas answered)" in d.signal


def test_the_average_reaches_a_steady_reading_and_does_not_linger_above_it() -> None:
    """An exponential average only nears a steady value: at a rule's boundary (2 waiting a
    replica against a target of 2; an empty queue with min_replicas 0) a ceiling would hold
    one replica more for minutes. Within half a request it is the reading."""
    p = policy(target_queue_per_replica=2, upscale_delay_seconds=60)
    clock = FakeClock(100.0)
    _, d = run(p, AutoscalerState(target=2), clock, 20, {QUEUE: reading(2, 2)})
    _, d = run(p, d.state, clock, 5, {QUEUE: reading(3, 3)})  # one scrape's worth above
    targets, d = run(p, d.state, clock, 120, {QUEUE: reading(2, 2)})
    assert set(targets) == {2} and d.demand == 2
    # to zero: the queue and the running requests gone, demand 0 within 20 s (the average of
    # 5 requests nears 0 by half a request in about 23 s; read as 0 from then)
    p = policy(
        target_queue_per_replica=1, min_replicas=0, downscale_delay_seconds=30, max_replicas=10
    )
    clock = FakeClock(100.0)
    _, d = run(p, AutoscalerState(target=1), clock, 30, engines([3], [2]), inflight=5)
    targets, d = run(p, d.state, clock, 60, engines([0], [0]))
    assert d.demand == 0 and targets[-1] == 0


def test_a_running_count_not_read_is_forgotten_not_held() -> None:
    s, _ = A.smooth_queue(None, engines([8, 8], [0, 0]), 10.0)
    assert s == (10.0, 0.0, 16.0)
    s, out = A.smooth_queue(s, {QUEUE: reading(0, 0)}, 11.0)  # no running reading
    assert s is not None and s[2] == -1.0 and out is not None and RUNNING not in out
    s, out = A.smooth_queue(s, engines([1, 1], [0, 0]), 12.0)  # back: starts from the reading
    assert s is not None and s[2] == 2.0 and out is not None and out[RUNNING].mean == 1.0
