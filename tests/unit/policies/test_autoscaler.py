"""The autoscaler on a fake clock: request rate, in flight, instance-aware, delays in seconds,
scale from and to zero, overprovision, clipping, fallback counts, state round trip."""

from __future__ import annotations

import pytest

from fleetserve.core.clock import FakeClock
from fleetserve.policies.autoscaler import (
    AutoscalerState,
    LoadObservation,
    autoscale,
    fallback_targets,
    initial_state,
    needed_replicas,
)
from fleetserve.spec.models import ReplicaPolicy


def policy(**kw: object) -> ReplicaPolicy:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 5,
        "target_qps_per_replica": 2,
        "upscale_delay_seconds": 10,
        "downscale_delay_seconds": 30,
        "qps_window_seconds": 10,
    }
    base.update(kw)
    return ReplicaPolicy.model_validate(base)


def run(
    p: ReplicaPolicy,
    seconds: int,
    rps: int,
    state: AutoscalerState,
    clock: FakeClock,
    inflight: int = 0,
) -> tuple[list[int], AutoscalerState]:
    """One decision a second for `seconds` at `rps` requests a second; the targets seen."""
    targets = []
    for _ in range(seconds):
        clock.advance(1)
        d = autoscale(p, state, LoadObservation(new_requests=rps, inflight=inflight), clock.now())
        state = d.state
        targets.append(d.target)
    return targets, state


@pytest.mark.parametrize(
    ("kw", "qps", "inflight", "accelerator", "expected"),
    [
        ({"target_qps_per_replica": 2}, 7.0, 0, None, 4),
        ({"target_qps_per_replica": 2}, 8.0, 0, None, 4),
        ({"target_qps_per_replica": None, "target_ongoing_requests_per_replica": 4}, 0, 9, None, 3),
        ({"target_ongoing_requests_per_replica": 10}, 2.0, 35, None, 4),  # the larger need wins
        (
            {
                "target_qps_per_replica": {"A100": 10, "L4": 2},
                "load_balancing_policy": "instance_aware_least_load",
            },
            20.0,
            0,
            "A100:1",
            2,
        ),
        (
            {"target_qps_per_replica": {"A100": 10, "L4": 2}},
            20.0,
            0,
            None,
            10,  # type unknown: the smallest capacity, conservatively
        ),
    ],
)
def test_needed_replicas(
    kw: dict[str, object], qps: float, inflight: int, accelerator: str | None, expected: int
) -> None:
    kw = {k: v for k, v in kw.items() if k != "load_balancing_policy"}
    assert needed_replicas(policy(**kw), qps, inflight, accelerator) == expected


def test_upscale_waits_for_sustained_demand_in_seconds() -> None:
    p, clock = policy(), FakeClock(1000)
    targets, state = run(p, 10, 8, initial_state(p), clock)  # 8 rps: the window fills over 10 s
    assert targets[0] == 1 and targets[-1] == 1  # not before the 10 s delay has passed
    targets, state = run(p, 12, 8, state, clock)
    assert targets[-1] == 4  # 8 rps / 2 per replica, once it lasted 10 s
    assert state.above_since is None


def test_a_burst_shorter_than_the_delay_does_not_scale_up() -> None:
    # A 5 s burst stays in the 10 s rate window for 15 s at most: under the 30 s delay.
    p, clock = policy(upscale_delay_seconds=30), FakeClock(1000)
    targets, state = run(p, 5, 20, initial_state(p), clock)
    targets2, _ = run(p, 20, 0, state, clock)
    assert max(targets + targets2) == 1


def test_downscale_waits_then_never_below_min() -> None:
    p, clock = policy(), FakeClock(1000)
    state = AutoscalerState(target=4)
    targets, state = run(p, 29, 0, state, clock)
    assert set(targets) == {4}  # 30 s of low demand are needed
    targets, state = run(p, 3, 0, state, clock)
    assert targets[-1] == 1  # min_replicas


def test_scale_from_zero_at_once_and_to_zero_after_a_quiet_delay() -> None:
    p, clock = policy(min_replicas=0), FakeClock(1000)
    state = AutoscalerState(target=0)
    clock.advance(1)
    d = autoscale(p, state, LoadObservation(new_requests=0, inflight=0, queued=1), clock.now())
    assert d.target == 1 and "from zero" in d.reason  # no upscale delay for the first request
    targets, state = run(p, 25, 0, d.state, clock)
    assert set(targets) == {1}  # requests came within the downscale delay
    targets, state = run(p, 10, 0, state, clock)
    assert targets[-1] == 0


def test_overprovision_and_max_clipping() -> None:
    p, clock = policy(num_overprovision=1, max_replicas=3), FakeClock(1000)
    targets, _ = run(p, 25, 50, initial_state(p), clock)
    assert targets[-1] == 4  # clipped to max 3, plus one spare


def test_in_flight_policy() -> None:
    p = policy(target_qps_per_replica=None, target_ongoing_requests_per_replica=2)
    clock = FakeClock(1000)
    targets, _ = run(p, 12, 1, initial_state(p), clock, inflight=7)
    assert targets[-1] == 4


def test_state_round_trips_through_json() -> None:
    p, clock = policy(), FakeClock(1000)
    _, state = run(p, 5, 8, initial_state(p), clock)
    again = AutoscalerState.from_json(state.to_json())
    assert again == state
    # A restarted controller with the persisted state decides exactly as the old one would.
    a = autoscale(p, state, LoadObservation(8, 0), clock.now() + 1)
    b = autoscale(p, again, LoadObservation(8, 0), clock.now() + 1)
    assert a == b


@pytest.mark.parametrize(
    ("base", "dynamic", "target", "ready_spot", "expected"),
    [
        (0, False, 4, 0, (4, 0)),
        (1, False, 4, 0, (3, 1)),
        (1, True, 4, 1, (3, 3)),  # 2 spot missing: 2 more on demand meanwhile
        (1, True, 4, 3, (3, 1)),
        (5, False, 2, 0, (0, 2)),
    ],
)
def test_fallback_targets(
    base: int, dynamic: bool, target: int, ready_spot: int, expected: tuple[int, int]
) -> None:
    p = ReplicaPolicy(
        min_replicas=1,
        max_replicas=5,
        target_qps_per_replica=1,
        base_ondemand_fallback_replicas=base,
        dynamic_ondemand_fallback=dynamic,
    )
    t = fallback_targets(p, target, ready_spot, uses_spot=True)
    assert (t.spot, t.on_demand) == expected
    assert fallback_targets(p, target, ready_spot, uses_spot=False).on_demand == target
