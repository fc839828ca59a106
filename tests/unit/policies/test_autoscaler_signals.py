"""The autoscaler on what the replicas report (engine queue, KV cache, any gauge) and on the
latency the load balancer measures, on a fake clock: each signal, missing and partial
answers, the latency band, the delays, the state's round trip."""

from __future__ import annotations

import json

import pytest

from fleetserve.core.clock import FakeClock
from fleetserve.policies.autoscaler import (
    KV_CACHE,
    QUEUE,
    AutoscalerState,
    Decision,
    LoadObservation,
    SignalReading,
    autoscale,
    metric_key,
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
    state = AutoscalerState(target=1)
    targets, d = run(p, state, clock, 9, {QUEUE: reading(6)})
    assert set(targets) == {1} and "above 1 since" in d.reason
    # a dip below the target resets the upscale timer
    targets, d = run(p, d.state, clock, 1, {QUEUE: reading(1)})
    targets, d = run(p, d.state, clock, 9, {QUEUE: reading(6)})
    assert set(targets) == {1}
    targets, d = run(p, d.state, clock, 2, {QUEUE: reading(6)})
    assert targets[-1] == 3
    assert d.reason.startswith("engine queue 6/replica, target 2: demand 3 above 1 for 10 s")


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
