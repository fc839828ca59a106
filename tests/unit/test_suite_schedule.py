"""How the suite spreads over xdist's workers (tests/conftest.py): a file's tests on one worker,
except the SPLIT files' (each test a unit of its own), the longest first. These hold the lists
to the files they name, so that a rename or a new shared fixture does not silently undo them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import LONGEST_FIRST, SPLIT, _rank, work_unit

ROOT = Path(__file__).resolve().parents[2]


def _shared_fixtures(path: Path) -> list[str]:
    """Fixtures a file defines with a scope wider than one test (each worker that runs one of
    its tests would set them up again)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("fixture"):
                for kw in deco.keywords:
                    if kw.arg == "scope" and ast.unparse(kw.value) != "'function'":
                        found.append(f"{node.name} (scope={ast.unparse(kw.value)})")
    return found


# Shared fixtures a split file may keep: ones that set nothing up. (The chaos seeds' summary
# of a soak collects what the seeds that ran on one worker report; a soak runs in one process.)
HARMLESS = {"tests/e2e/test_chaos.py": ["soak_summary (scope='module')"]}


@pytest.mark.parametrize("path", sorted(SPLIT))
def test_a_split_file_shares_no_fixture_between_its_tests(path: str) -> None:
    assert (ROOT / path).is_file(), path
    shared = _shared_fixtures(ROOT / path)
    assert shared == HARMLESS.get(path, []), f"{path}: its tests would run apart"


def test_the_check_finds_a_module_fixture() -> None:
    # test_vllm.py's one fleet for the whole module is why that file is not split.
    assert _shared_fixtures(ROOT / "tests/e2e/test_vllm.py") == ["served (scope='module')"]


def test_every_longest_first_entry_names_a_file_or_a_test_that_exists() -> None:
    for entry in LONGEST_FIRST:
        path, _, test = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if test:
            names = {
                n.name
                for n in ast.walk(ast.parse((ROOT / path).read_text()))
                if isinstance(n, ast.FunctionDef)
            }
            assert test in names, entry


def test_work_units_and_order() -> None:
    chaos = "tests/e2e/test_chaos.py::test_kill_9_at_random_points_then_the_fleet_converges[7]"
    assert work_unit(chaos) == chaos  # a split file's test alone
    vllm = "tests/e2e/test_vllm.py::test_chat_completions_stream_token_by_token"
    assert work_unit(vllm) == "tests/e2e/test_vllm.py"  # the module's fleet: one worker
    assert work_unit("tests/unit/test_spot_sim.py::test_x") == "tests/unit/test_spot_sim.py"
    # The order: listed tests by their rank (a parametrized one by its name), the rest after.
    assert _rank(vllm) == 0
    assert _rank(chaos) == 1
    pools = "tests/e2e/test_pools.py::test_a_pool_of_three_runs_thirty_jobs_each_rank_once"
    assert _rank(pools) == LONGEST_FIRST.index("tests/e2e/test_pools.py")
    assert _rank("tests/unit/test_spot_sim.py::test_x") == len(LONGEST_FIRST)
