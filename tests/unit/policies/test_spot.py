"""Spot placers (fleetserve.policies.spot): SkyServe's dynamic_fallback as its code behaves, and
fleetserve's adaptive placer, each on hand-made event sequences."""

from __future__ import annotations

import json

import pytest

from fleetserve.policies.spot import Adaptive, DynamicFallback, make_placer

ZONES = ["a", "b", "c"]
PRICES = {"a": 1.0, "b": 1.0, "c": 2.0}


def test_dynamic_fallback_prefers_the_cheapest_active_zone_with_no_replica() -> None:
    p = DynamicFallback(ZONES, PRICES, seed=1)
    assert p.select({"a": 1, "b": 0, "c": 0}, 0) == "b"  # a holds one; c costs more
    assert p.select({"a": 1, "b": 1, "c": 0}, 0) == "c"  # the only unused one
    assert p.select({"a": 1, "b": 1, "c": 1}, 0) in ("a", "b")  # all used: cheapest active


def test_dynamic_fallback_marks_zones_and_resets_when_fewer_than_two_are_active() -> None:
    p = DynamicFallback(ZONES, PRICES, seed=0)
    p.preempted("a", 10)
    assert p.active == {"a": False, "b": True, "c": True}
    assert p.select({}, 11) == "b"
    p.launch_failed("b", 12)  # one ACTIVE left: SkyServe makes every zone ACTIVE again
    assert all(p.active.values())
    p.preempted("c", 13)
    restored = DynamicFallback(ZONES, PRICES)
    restored.restore(p.state())  # a restarted controller keeps the marks
    assert restored.active == p.active == {"a": True, "b": True, "c": False}


def test_dynamic_fallback_breaks_ties_at_random_but_reproducibly() -> None:
    placers = [make_placer("dynamic_fallback", ZONES, PRICES, seed=s) for s in range(20)]
    picks = {p.select({}, 0) for p in placers}
    assert picks == {"a", "b"}  # both cheapest zones get chosen, never the dearer one
    one = [DynamicFallback(ZONES, PRICES, seed=7).select({}, 0) for _ in range(3)]
    assert len(set(one)) == 1


def test_adaptive_backs_off_a_zone_whose_launch_failed_and_doubles_it() -> None:
    p = Adaptive(ZONES, PRICES, backoff=60, max_backoff=200)
    p.launch_failed("a", 0)
    assert p.select({}, 30) == "b"  # a is left alone for 60 s
    assert p.select({"a": 0, "b": 1, "c": 1}, 61) == "a"  # open again
    p.launch_failed("a", 61)
    p.launch_failed("a", 200)
    assert p.blocked_until["a"] == 200 + 200  # 60, 120, then capped at 200
    for z in ("b", "c"):
        p.launch_failed(z, 200)
    assert p.select({}, 201) is None  # every zone just refused: none is tried
    for i in range(5000):  # a zone that never has capacity: the back-off stays capped
        p.launch_failed("c", 1000 + i)
    assert p.blocked_until["c"] == 1000 + 4999 + 200


def test_adaptive_spreads_first_then_avoids_the_zone_preempted_recently() -> None:
    p = Adaptive(ZONES, PRICES, half_life=3600)
    p.preempted("a", 0)
    assert p.select({"a": 0, "b": 0, "c": 0}, 10) == "b"  # b: no risk, cheaper than c
    assert p.select({"a": 0, "b": 1, "c": 1}, 10) == "a"  # a holds none: spreading comes first
    p.preempted("b", 0)
    assert p.select({"a": 0, "b": 0, "c": 0}, 10) == "c"
    # The risk halves every half-life: long after, a and b are as good as c again.
    assert p.select({"a": 0, "b": 0, "c": 0}, 3600 * 30) == "a"


def test_adaptive_hedges_a_lost_spare_with_on_demand_only_soon_after_a_preemption() -> None:
    p = Adaptive(ZONES, PRICES, hedge_window=1000)
    p.observe(0, ready_spot=0)
    assert p.fallback_basis(4, 1) == 4  # quiet: the spare is the hedge
    p.preempted("a", 100)
    p.observe(500, ready_spot=3)
    assert p.fallback_basis(4, 1) == 5  # soon after a preemption: as SkyServe
    p.observe(1200, ready_spot=4)
    assert p.fallback_basis(4, 1) == 4


def test_adaptive_keeps_one_more_spare_while_correlated_preemptions_recur() -> None:
    p = Adaptive(
        ZONES, PRICES, together=60, burst_groups=2, burst_memory=6000, burst_spare_for=3000
    )
    p.preempted("a", 0)
    p.preempted("b", 500)  # minutes apart: not a correlated group
    assert p.overprovision(1, 4, 600) == 1
    p.preempted("a", 1000)
    p.preempted("b", 1000)  # two zones in the same round: one correlated group ...
    p.preempted("c", 1030)  # ... which a third zone within `together` joins, not a new group
    assert p.groups == [1000]
    assert p.overprovision(1, 4, 1100) == 1  # one group alone may be a one-off
    p.preempted("b", 4000)
    p.preempted("c", 4010)  # a second group within burst_memory: a burst
    assert p.overprovision(1, 4, 4100) == 2
    p.observe(4100, ready_spot=4)
    # The burst spare is spot only: on-demand stands in for the configured spare at most.
    assert p.fallback_basis(4, 2) == 5
    q = Adaptive(ZONES, PRICES)
    q.restore(p.state())  # a restarted controller keeps the burst
    assert q.overprovision(1, 4, 4100) == 2 and q.groups == p.groups
    assert p.overprovision(1, 4, 4010 + 3000) == 2
    assert p.overprovision(1, 4, 4010 + 3001) == 1  # quiet again: back to the configured
    p.preempted("a", 20000)
    p.preempted("c", 20000)  # the earlier groups are older than burst_memory
    assert p.overprovision(1, 4, 20100) == 1


def test_adaptive_state_survives_a_restart() -> None:
    p = Adaptive(ZONES, PRICES)
    p.preempted("a", 50)
    p.launch_failed("b", 60)
    q = Adaptive(ZONES, PRICES)
    q.restore(p.state())
    assert q.blocked_until == p.blocked_until and q.last_preemption == 50
    assert q.select({}, 61) == p.select({}, 61) == "c"
    q.restore({"risk": {"zz": 9, "a": "bad"}, "last_preemption": "x"})  # junk is ignored
    assert q.last_preemption == 50
    q.restore({"recent": [["zz", 1], [["a"], 2], ["a", "x"], "b", ["c", 70]], "groups": ["x"]})
    assert q.recent == [("c", 70.0)] and q.groups == []
    json.dumps(p.state())  # what a controller persists is plain JSON


def test_an_unknown_placer_is_named() -> None:
    with pytest.raises(ValueError, match="unknown spot placer 'best'"):
        make_placer("best", ZONES, PRICES)
    with pytest.raises(ValueError, match="at least one zone"):
        make_placer("adaptive", [], PRICES)
