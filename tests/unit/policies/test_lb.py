"""Load-balancing selectors, as tables."""

from __future__ import annotations

import pytest

from fleetserve.policies.lb import LeastLoad, RoundRobin, make_selector


def test_round_robin_cycles_and_skips_excluded() -> None:
    rr = RoundRobin()
    picks = [rr.select([1, 2, 3], {}, frozenset()) for _ in range(6)]
    assert picks == [1, 2, 3, 1, 2, 3]
    assert rr.select([1, 2, 3], {}, frozenset({1})) == 2
    assert rr.select([1, 2], {}, frozenset({1, 2})) is None
    assert rr.select([], {}, frozenset()) is None


def test_round_robin_survives_a_shrinking_set() -> None:
    rr = RoundRobin()
    for _ in range(5):
        rr.select([1, 2, 3, 4, 5], {}, frozenset())
    assert rr.select([7], {}, frozenset()) == 7


@pytest.mark.parametrize(
    ("inflight", "exclude", "expected"),
    [
        ({1: 3, 2: 1, 3: 2}, frozenset(), 2),
        ({1: 3, 2: 1, 3: 2}, frozenset({2}), 3),
        ({1: 0, 2: 5}, frozenset(), 1),
        ({}, frozenset({1, 2, 3}), None),
    ],
)
def test_least_load_picks_the_fewest_in_flight(
    inflight: dict[int, int], exclude: frozenset[int], expected: int | None
) -> None:
    assert LeastLoad().select([1, 2, 3], inflight, exclude) == expected


def test_least_load_spreads_ties() -> None:
    ll = LeastLoad()
    assert {ll.select([1, 2, 3], {}, frozenset()) for _ in range(3)} == {1, 2, 3}


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown load_balancing_policy"):
        make_selector("random")
