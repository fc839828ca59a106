"""Fleet size before autoscaling: min_replicas, and scale from / to zero on demand."""

from __future__ import annotations

import pytest

from fleetserve.policies.demand import fleet_target


@pytest.mark.parametrize(
    ("min_r", "max_r", "last", "now", "expected"),
    [
        (2, 2, None, 100.0, 2),  # a fixed fleet
        (0, 3, None, 100.0, 0),  # never asked: stays at zero
        (0, 3, 95.0, 100.0, 1),  # a request 5 s ago: one replica
        (0, 3, 89.0, 100.0, 0),  # idle longer than the 10 s delay: back to zero
        (0, 0, 99.0, 100.0, 0),  # max 0 means stopped
    ],
)
def test_fleet_target(
    min_r: int, max_r: int, last: float | None, now: float, expected: int
) -> None:
    assert fleet_target(min_r, max_r, last, now, idle_seconds=10) == expected
