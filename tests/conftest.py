"""Fixtures shared by unit and end-to-end tests: a private PostgreSQL server (tests/pg.py)."""

import pytest

from tests.pg import pg_cluster, pg_url

__all__ = ["pg_cluster", "pg_url"]


# The files that take longest (minutes: real vLLM starts, Ray clusters, many fleets) run
# first, so that with parallel workers (scripts/test.sh: pytest-xdist, one file per worker at
# a time) the suite does not wait at its end for one long file that started last.
LONGEST_FIRST = (
    "tests/e2e/test_vllm.py",
    "tests/e2e/test_kv_events_vllm.py",
    "tests/ray/test_ray_infra.py",
    "tests/e2e/test_pools.py",
    "tests/e2e/test_trust.py",
    "tests/e2e/test_service_lifecycle.py",
    "tests/e2e/test_updates.py",
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_spot_chaos.py",
    "tests/e2e/test_userns_fleet.py",
    "tests/ray/test_ray_ha.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
