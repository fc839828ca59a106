"""Fixtures shared by unit and end-to-end tests: a private PostgreSQL server (tests/pg.py)."""

from typing import Any

import pytest

from tests.pg import pg_cluster, pg_url

__all__ = ["pg_cluster", "pg_url"]


# The suite runs on parallel workers (scripts/test.sh: pytest-xdist, `--dist loadfile`). A file's
# tests run on one worker, in order (they may share a module's fixtures: one vLLM fleet, one
# Ray cluster), except in SPLIT files, whose tests are independent and long: each of those goes
# to whichever worker is free (the scheduler below). The longest run first (this order, with
# xdist's own reordering by test count turned off: `--no-loadscope-reorder`), so that the suite
# does not wait at its end for a long test that started last. Measured per test on 2 cores
# (junit XML of a whole run); a test not listed runs after these, in file order.
LONGEST_FIRST = (
    "tests/e2e/test_vllm.py",
    "tests/e2e/test_chaos.py::test_kill_9_at_random_points_then_the_fleet_converges",
    "tests/e2e/test_updates.py::test_update_errors_are_clear_and_change_nothing",
    "tests/e2e/test_spot_chaos.py::test_zones_in_status_and_a_zone_outage_by_hand",
    "tests/e2e/test_pools.py::test_a_job_cannot_break_its_worker_for_the_next_ones",
    "tests/e2e/test_pools.py::test_service_commands_keep_pool_rules_and_a_broken_pool_fails_its_queue",
    "tests/e2e/test_userns_fleet.py",
    "tests/e2e/test_kv_events_vllm.py",
    "tests/ray/test_ray_infra.py",
    "tests/e2e/test_updates.py",
    "tests/e2e/test_pools.py",
    "tests/e2e/test_trust.py",
    "tests/e2e/test_service_lifecycle.py",
    "tests/e2e/test_spot_chaos.py",
    "tests/e2e/test_chaos.py",
    "tests/ray/test_ray_ha.py",
)
SPLIT = frozenset(
    {
        "tests/e2e/test_chaos.py",
        "tests/e2e/test_updates.py",
        "tests/e2e/test_spot_chaos.py",
        "tests/e2e/test_pools.py",
        "tests/e2e/test_service_lifecycle.py",
        "tests/e2e/test_trust.py",
    }
)


def _rank(nodeid: str) -> int:
    for i, prefix in enumerate(LONGEST_FIRST):
        if nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "[")):
            return i
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: file order within a rank


def work_unit(nodeid: str) -> str:
    """What runs on one worker: the test's file, or the test alone in a SPLIT file."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPLIT else path


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, but a SPLIT file's tests each a unit of their own. (xdist's
    `loadgroup` would say this with marks, but its grouping does not take on pytest 9: it
    rewrites a private attribute that pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SplitLongFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SplitLongFiles(config, log)
