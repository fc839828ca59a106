"""The dashboard's rings: rates and quantiles from two reports' counters, restarts of the
load balancer, bounds on points and series."""

from __future__ import annotations

import pytest

from fleetserve.controller.history import SERVICE, History, quantile, window_percentile_ms
from fleetserve.lb.messages import LoadReport

BOUNDS = [0.01, 0.1, 1.0]


def report(
    totals: dict[str, tuple[int, int, list[int]]], inflight: dict[str, int] | None = None
) -> LoadReport:
    return LoadReport.model_validate(
        {
            "latency_bounds": BOUNDS,
            "replicas": {k: {"inflight": v} for k, v in (inflight or {}).items()},
            "totals": {
                k: {"requests": r, "errors": e, "latency": lat} for k, (r, e, lat) in totals.items()
            },
        }
    )


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [
        ([0, 0, 0, 0], 0.5, None),  # nothing observed
        ([10, 10, 10, 10], 0.5, 0.005),  # all under 10 ms: halfway into the first bucket
        ([0, 10, 10, 10], 0.5, 0.055),  # all in (10 ms, 100 ms]
        ([0, 0, 0, 10], 0.99, 1.0),  # all past the last bound: the last bound
        ([50, 90, 100, 100], 0.99, 0.91),  # 99th of 100 in (0.1, 1]: 9/10 of the way
    ],
)
def test_quantile(counts: list[int], q: float, expected: float | None) -> None:
    got = quantile(BOUNDS, counts, q)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_rates_and_quantiles_come_from_two_reports() -> None:
    h = History(step=5.0)
    versions = {1: 1, 2: 1}
    assert h.observe(100.0, report({"1": (0, 0, [0, 0, 0, 0])}), 2, 2, versions)
    assert not h.observe(102.0, report({"1": (5, 0, [5, 5, 5, 5])}), 2, 2, versions)  # < step
    h.observe(
        105.0,
        report(
            {
                "1": (50, 5, [50, 50, 50, 50]),
                "2": (10, 0, [0, 10, 10, 10]),
                "none": (3, 3, [3, 3, 3, 3]),
            },
            {"1": 4},
        ),
        2,
        3,
        versions,
    )
    r1 = h.series[1][-1]
    assert r1.rps == pytest.approx(10.0) and r1.errors == pytest.approx(1.0)
    assert r1.inflight == 4 and r1.version == 1
    assert r1.p50 == pytest.approx(0.005)
    r2 = h.series[2][-1]  # first seen now: counted from zero
    assert r2.rps == pytest.approx(2.0) and r2.p50 == pytest.approx(0.055)
    s = h.series[SERVICE][-1]
    assert s.rps == pytest.approx((50 + 10 + 3) / 5) and s.errors == pytest.approx(8 / 5)
    assert (s.ready, s.target, s.inflight) == (2, 3, 4)


def test_a_restarted_load_balancer_counts_from_zero() -> None:
    h = History(step=1.0)
    h.observe(0.0, report({"1": (1000, 0, [1000, 1000, 1000, 1000])}), 1, 1, {1: 1})
    h.observe(1.0, report({"1": (7, 0, [7, 7, 7, 7])}), 1, 1, {1: 1})
    assert h.series[1][-1].rps == pytest.approx(7.0)  # not -993


def test_no_report_leaves_a_gap_but_keeps_target_and_ready() -> None:
    h = History(step=1.0)
    h.observe(0.0, None, 0, 1, {})
    p = h.series[SERVICE][-1]
    assert p.rps is None and p.p99 is None and (p.ready, p.target) == (0, 1)


def test_rings_are_bounded_in_points_and_series() -> None:
    h = History(step=1.0, horizon=10.0, max_replicas=3)
    for t in range(100):
        versions = {rid: 1 for rid in range(1, 1 + t % 7)}
        totals = {str(rid): (t, 0, [t, t, t, t]) for rid in versions}
        h.observe(float(t), report(totals), len(versions), len(versions), versions)
    assert len(h.series[SERVICE]) == 10
    assert len([k for k in h.series if k != SERVICE]) <= 3
    assert all(len(ring) <= 10 for ring in h.series.values())


def test_a_replica_gone_from_the_books_gets_no_more_points() -> None:
    h = History(step=1.0, horizon=5.0)
    h.observe(0.0, report({"1": (1, 0, [1, 1, 1, 1])}), 1, 1, {1: 1})
    for t in range(1, 8):  # the LB still counts replica 1, but it was terminated
        h.observe(float(t), report({"1": (1, 0, [1, 1, 1, 1])}), 0, 0, {})
    assert 1 not in h.series  # forgotten past the horizon


def test_since_returns_only_newer_points() -> None:
    h = History(step=1.0)
    for t in range(5):
        h.observe(float(t), None, 0, 0, {})
    assert [p.at for p in h.since(2.0)[SERVICE]] == [3.0, 4.0]
    assert len(h.since(None)[SERVICE]) == 5


def timed(
    latency: dict[str, list[int]], first_byte: dict[str, list[int]] | None = None
) -> LoadReport:
    """A report with per-replica duration and time-to-first-byte histograms."""
    first_byte = first_byte or {}
    keys = set(latency) | set(first_byte)
    return LoadReport.model_validate(
        {
            "latency_bounds": BOUNDS,
            "totals": {
                k: {"latency": latency.get(k, []), "first_byte": first_byte.get(k, [])}
                for k in keys
            },
        }
    )


def test_window_percentile_is_over_the_requests_between_two_reports() -> None:
    prev = timed({"1": [100, 100, 100, 100]}, {"1": [100, 100, 100, 100]})
    # Since then: replica 1 answered 10 more in (0.1, 1] s, after a first byte in (10, 100] ms;
    # replica 2 (new) 10 in (10, 100] ms, first byte under 10 ms.
    cur = timed(
        {"1": [100, 100, 110, 110], "2": [0, 10, 10, 10]},
        {"1": [100, 110, 110, 110], "2": [10, 10, 10, 10]},
    )
    # Of the window's 20 whole responses, the 90th percentile is the 18th: 8/10 into (0.1, 1].
    assert window_percentile_ms(prev, cur, 0.9, first_byte=False) == pytest.approx(820.0)
    # Of their first bytes, the median is the 10th: the top of the first bucket.
    assert window_percentile_ms(prev, cur, 0.5, first_byte=True) == pytest.approx(10.0)
    # The old 100 requests (all under 10 ms) do not count: without prev they would.
    assert window_percentile_ms(None, cur, 0.9, first_byte=False) == pytest.approx(82.0)


def test_window_percentile_is_none_without_a_new_request() -> None:
    cur = timed({"1": [5, 5, 5, 5], "none": [0, 0, 0, 7]}, {"1": [5, 5, 5, 5]})
    assert window_percentile_ms(cur, cur, 0.9, first_byte=True) is None
    assert window_percentile_ms(cur, cur, 0.9, first_byte=False) is None
    # The load balancer's own answers ('none') are no replica's latency.
    only_lb = timed({"none": [0, 0, 0, 7]})
    assert window_percentile_ms(None, only_lb, 0.5, first_byte=False) is None
    assert window_percentile_ms(None, timed({}), 0.5, first_byte=True) is None


def test_window_percentile_after_a_restarted_load_balancer_uses_the_new_report_alone() -> None:
    prev = timed({"1": [0, 0, 1000, 1000]})
    cur = timed({"1": [0, 10, 10, 10]})  # counters went down: it counts from zero again
    assert window_percentile_ms(prev, cur, 0.5, first_byte=False) == pytest.approx(55.0)
    # A replica whose counters vanished (a worker gone with them) is a restart too.
    prev = timed({"1": [0, 0, 1000, 1000], "2": [0, 0, 5, 5]})
    cur = timed({"2": [0, 10, 15, 15]})
    assert window_percentile_ms(prev, cur, 0.5, first_byte=False) == pytest.approx(77.5)


def test_window_percentile_of_an_older_load_balancer_without_first_bytes_is_none() -> None:
    old = timed({"1": [10, 10, 10, 10]})  # first_byte: [] (a report before the field)
    assert window_percentile_ms(None, old, 0.9, first_byte=True) is None
    assert window_percentile_ms(None, old, 0.9, first_byte=False) == pytest.approx(9.0)
    # Upgraded between two reports: the new one's counts alone.
    new = timed({"1": [20, 20, 20, 20]}, {"1": [0, 20, 20, 20]})
    assert window_percentile_ms(old, new, 0.5, first_byte=True) == pytest.approx(55.0)
    assert window_percentile_ms(old, new, 0.5, first_byte=False) == pytest.approx(5.0)


@pytest.mark.parametrize("q", [0.0, 1.0, 90.0, -0.5])
def test_window_percentile_refuses_a_quantile_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match="q must be in"):
        window_percentile_ms(None, timed({}), q, first_byte=True)
