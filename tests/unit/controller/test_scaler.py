"""`Scaler`: the target from load reports, on the fake clock, with its state in the store."""

from __future__ import annotations

import pytest

from fleetserve.controller.scaling import STATE_KEY, Scaler
from fleetserve.core.clock import FakeClock
from fleetserve.lb.messages import LoadReport
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.models import ServiceTask
from fleetserve.store import Store

from .fakes import create_service, service_yaml


def autoscaled_yaml(min_replicas: int = 1, max_replicas: int = 5, upscale: float = 0) -> str:
    return (
        "service:\n"
        "  readiness_probe: /health\n"
        "  replica_policy:\n"
        f"    min_replicas: {min_replicas}\n"
        f"    max_replicas: {max_replicas}\n"
        "    target_qps_per_replica: 1\n"
        "    qps_window_seconds: 10\n"
        f"    upscale_delay_seconds: {upscale:g}\n"
        "    downscale_delay_seconds: 60\n"
        "run: python3 server.py\n"
    )


AUTOSCALED: ServiceTask = parse_spec(autoscaled_yaml())


def scaler_for(store: Store, clock: FakeClock, name: str, yaml_text: str) -> Scaler:
    if store.get_service(name) is None:
        create_service(store, name, yaml_text, clock.now())
    return Scaler(name, store, clock, interval=1.0)


def report(total: int, queued: int = 0, **inflight: int) -> LoadReport:
    replicas = {rid.removeprefix("r"): {"inflight": n} for rid, n in inflight.items()}
    return LoadReport.model_validate(
        {"total_requests": total, "queued": queued, "replicas": replicas}
    )


@pytest.mark.parametrize(
    ("totals", "target"),
    [
        ([], 1),  # no report: min_replicas
        ([500], 1),  # the first report is only the baseline of the request count
        ([100, 130], 3),  # 30 requests in a 10 s window: 3 req/s, 1 per replica
        ([100, 200], 5),  # 10 req/s, capped at max_replicas
        ([100, 20], 2),  # a restarted LB counts from zero: its 20 requests are new
    ],
)
def test_target_follows_the_request_rate(
    store: Store, clock: FakeClock, totals: list[int], target: int
) -> None:
    scaler = scaler_for(store, clock, "a", autoscaled_yaml())
    for total in totals:
        scaler.observe(report(total))
    assert scaler.target(AUTOSCALED) == target
    assert scaler.last is not None
    assert store.get_policy_state("a", STATE_KEY) == scaler.last.state.to_json()


def test_a_fixed_fleet_is_min_replicas_and_keeps_no_state(store: Store, clock: FakeClock) -> None:
    scaler = scaler_for(store, clock, "a", service_yaml(replicas=3))
    scaler.observe(report(100))
    scaler.observe(report(1_000))
    assert scaler.target(parse_spec(service_yaml(replicas=3))) == 3
    assert store.get_policy_state("a", STATE_KEY) is None


def test_one_decision_per_interval_unless_a_request_is_held(store: Store, clock: FakeClock) -> None:
    scaler = scaler_for(store, clock, "a", autoscaled_yaml())
    assert scaler.target(AUTOSCALED) == 1
    scaler.observe(report(0))
    scaler.observe(report(30))
    clock.advance(0.5)
    assert scaler.target(AUTOSCALED) == 1  # the last decision holds within the interval
    clock.advance(0.5)
    assert scaler.target(AUTOSCALED) == 3  # decided again: 30 requests in the 10 s window

    zero = parse_spec(autoscaled_yaml(min_replicas=0))
    idle = scaler_for(store, clock, "idle", autoscaled_yaml(min_replicas=0))
    assert idle.target(zero) == 0
    clock.advance(0.1)
    idle.observe(report(0, queued=1))
    assert idle.target(zero) == 1  # a held request: scale from zero at once


@pytest.mark.parametrize(
    ("load", "replica_id", "inflight"),
    [
        (None, 1, 0),
        (report(0, r1=4, r2=1), 1, 4),
        (report(0, r1=4, r2=1), 2, 1),
        (report(0, r1=4), 3, 0),
    ],
)
def test_inflight_of_reads_the_latest_report(
    store: Store, clock: FakeClock, load: LoadReport | None, replica_id: int, inflight: int
) -> None:
    scaler = scaler_for(store, clock, "a", autoscaled_yaml())
    scaler.observe(load)
    assert scaler.inflight_of(replica_id) == inflight


def test_two_services_keep_their_own_state_across_a_restart(store: Store, clock: FakeClock) -> None:
    names = ("busy", "quiet")
    busy = scaler_for(store, clock, "busy", autoscaled_yaml())
    quiet = scaler_for(store, clock, "quiet", autoscaled_yaml())
    busy.observe(report(0, r1=2))
    busy.observe(report(40, r1=2))
    quiet.observe(report(0))
    assert (busy.target(AUTOSCALED), quiet.target(AUTOSCALED)) == (4, 1)
    assert {n: (store.get_policy_state(n, STATE_KEY) or {}).get("target") for n in names} == {
        "busy": 4,
        "quiet": 1,
    }
    assert [e.message for e in store.list_events("busy") if e.kind == "autoscaler"]
    assert not [e for e in store.list_events("quiet") if e.kind == "autoscaler"]

    # A restarted controller, once the requests left the 10 s window: "busy" carries on at 4
    # (the 60 s downscale delay starts now), "quiet" at 1; neither takes the other's state.
    clock.advance(20)
    busy, quiet = Scaler("busy", store, clock), Scaler("quiet", store, clock)
    assert (busy.target(AUTOSCALED), quiet.target(AUTOSCALED)) == (4, 1)
    clock.advance(60)
    assert busy.target(AUTOSCALED) == 1  # a whole downscale delay below: it shrinks


def test_an_update_that_raises_min_replicas_applies_at_once(store: Store, clock: FakeClock) -> None:
    scaler = scaler_for(store, clock, "a", autoscaled_yaml(upscale=300))
    assert scaler.target(parse_spec(autoscaled_yaml(upscale=300))) == 1
    clock.advance(2)
    assert scaler.target(parse_spec(autoscaled_yaml(min_replicas=3, upscale=300))) == 3


def test_an_update_that_lowers_max_replicas_applies_at_once(store: Store, clock: FakeClock) -> None:
    scaler = scaler_for(store, clock, "a", autoscaled_yaml())
    scaler.observe(report(0))
    scaler.observe(report(100))
    assert scaler.target(AUTOSCALED) == 5
    clock.advance(2)
    assert scaler.target(parse_spec(autoscaled_yaml(max_replicas=2))) == 2


def signals_yaml(extra: str) -> str:
    return (
        "service:\n"
        "  readiness_probe: /health\n"
        "  replica_policy:\n"
        "    min_replicas: 1\n"
        "    max_replicas: 5\n"
        f"{extra}"
        "    qps_window_seconds: 10\n"
        "    upscale_delay_seconds: 0\n"
        "    downscale_delay_seconds: 60\n"
        "run: python3 server.py\n"
    )


def test_replica_signals_reach_the_autoscaler_and_the_event_names_them(
    store: Store, clock: FakeClock
) -> None:
    from fleetserve.policies.autoscaler import QUEUE, SignalReading

    yaml_text = signals_yaml("    target_queue_per_replica: 2\n")
    scaler = scaler_for(store, clock, "q", yaml_text)
    spec = parse_spec(yaml_text)
    scaler.observe(report(0))
    clock.advance(1)
    assert scaler.target(spec, {QUEUE: SignalReading(7.5, 8.0, 2, 2)}) == 5  # ceil(15/2) -> max
    events = [e.message for e in store.list_events("q")]
    assert any(
        "autoscaler: target 1 -> 5 (engine queue 7.5/replica, target 2: demand 5 above 1" in e
        for e in events
    ), events
    # No answer at all: held, however long
    for _ in range(120):
        clock.advance(1)
        assert scaler.target(spec, {QUEUE: SignalReading(None, None, 0, 5)}) == 5
    assert scaler.signals[QUEUE].answered == 0


def latency_report(total: int, first_byte: list[int], latency: list[int]) -> LoadReport:
    bounds = [0.1, 0.5, 1.0]
    return LoadReport.model_validate(
        {
            "total_requests": total,
            "latency_bounds": bounds,
            "replicas": {"1": {"inflight": 1}},
            "totals": {"1": {"requests": total, "latency": latency, "first_byte": first_byte}},
        }
    )


def test_latency_is_measured_over_the_window_and_drives_the_target(
    store: Store, clock: FakeClock
) -> None:
    yaml_text = signals_yaml("    target_ttft_ms: 200\n    latency_percentile: 50\n")
    scaler = scaler_for(store, clock, "lat", yaml_text)
    spec = parse_spec(yaml_text)
    # 10 old requests all fast; then 10 more, all between 0.5 s and 1 s to the first byte
    scaler.observe(latency_report(10, [10, 10, 10, 10], [10, 10, 10, 10]))
    clock.advance(1)
    scaler.target(spec)
    assert scaler.latency_ms is not None and scaler.latency_ms <= 100
    clock.advance(11)  # past the window: the fast ones are out of it
    scaler.observe(latency_report(20, [10, 10, 20, 20], [10, 10, 10, 20]))
    target = scaler.target(spec)
    assert scaler.latency_ms is not None and 500 <= scaler.latency_ms <= 1000
    assert target == 2  # 1 replica, p50 TTFT above 200 ms: one more (at most twice)
