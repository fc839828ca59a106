"""`fleetserve simulate autoscale` and `fleetserve simulate spot`, and the spelling from
before the subcommands (`simulate --trace ...`, `simulate --spot-trace ...`): both spellings
run the same simulation and print the same bytes; each subcommand takes only its own options;
`--help` of the group and of each subcommand says what it does."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.core.errors import FleetserveError

BURST = ["--burst", "2:30:900:300", "--duration", "1200"]
AUTOSCALE_JSON = [*BURST, "--policy", "in_flight,skyserve", "--max", "4", "-o", "json"]
ENGINE = [
    "--burst",
    "0.5:2:3600:900",
    "--duration",
    "300",
    "--max",
    "2",
    "--policy",
    "queue",
    "--json",
]
SPOT = ["--duration", "21600", "--seeds", "2"]


def run(*args: str) -> tuple[int, str, str]:
    """Exit code, stdout, stderr; an error that reaches `main()` (fleetserve/cli/main.py)
    exits with its code and message as there."""
    res = CliRunner().invoke(app, list(args))
    if isinstance(res.exception, FleetserveError):
        return res.exception.exit_code, res.stdout, f"Error: {res.exception.message}"
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        (["simulate", *BURST], ["simulate", "autoscale", *BURST], None),
        (
            ["simulate", *AUTOSCALE_JSON],
            ["simulate", "autoscale", *AUTOSCALE_JSON],
            '"kind": "autoscaling"',
        ),
        (
            ["simulate", "--engine", *ENGINE],
            ["simulate", "autoscale", "--engine", *ENGINE],
            '"kind": "engine"',
        ),
        (["simulate", "--spot-trace", "GCP1", *SPOT], ["simulate", "spot", "GCP1", *SPOT], None),
        (
            ["simulate", "--spot-trace", "GCP1", *SPOT, "--policy", "on_demand,optimum", "--json"],
            ["simulate", "spot", "GCP1", *SPOT, "--policy", "on_demand,optimum", "--json"],
            '"kind": "spot"',
        ),
    ],
    ids=["autoscale-table", "autoscale-json", "engine-json", "spot-table", "spot-json"],
)
def test_both_spellings_print_the_same(old: list[str], new: list[str], kind: str | None) -> None:
    before, after = run(*old), run(*new)
    assert before[0] == 0, before
    assert after == before
    assert kind is None or kind in after[1]
    assert len(after[1].splitlines()) > 3


def test_a_request_trace_sets_the_spot_target_in_both_spellings(tmp_path: Path) -> None:
    csv = tmp_path / "rates.csv"
    csv.write_text("time_s,qps\n0,4\n3600,12\n7200,2\n")
    args = ["--trace", str(csv), "--target-qps", "4", "--min", "1", "--max", "5", *SPOT, "--json"]
    before = run("simulate", "--spot-trace", "GCP1", *args)
    assert before[0] == 0, before
    assert run("simulate", "spot", "GCP1", *args) == before


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["simulate", "autoscale", *BURST, "--start", "60"], "--start goes with --engine"),
        (["simulate", "autoscale", "--spot-trace", "GCP1"], "No such option"),
        (["simulate", "spot", "GCP1", "--engine"], "No such option"),
        (["simulate", "spot", "GCP1", "--burst", "1:2:3:4"], "No such option"),
        (["simulate", "spot"], "Missing argument 'SPOT_TRACE'"),
        (["simulate", "spot", "nowhere"], "nowhere"),
        (["simulate", "autoscale"], "give --trace FILE (or maf1) or --burst"),
        (["simulate", "--burst", "1:2"], "expected BASE:PEAK:PERIOD:LENGTH"),
        (["simulate", "autoscale", "--burst", "1:2"], "expected BASE:PEAK:PERIOD:LENGTH"),
        (["simulate", "spot", "GCP1", "--target", "1000"], "--target 1..100"),
        (["simulate", "--spot-trace", "GCP1", "--target", "1000"], "--target 1..100"),
    ],
)
def test_each_spelling_refuses_what_is_not_its_own(args: list[str], says: str) -> None:
    code, stdout, stderr = run(*args)
    assert code == 2 and says in stdout + stderr, (stdout, stderr)


def test_the_help_of_the_group_and_of_each_subcommand() -> None:
    code, group, _ = run("simulate", "--help")
    assert code == 0
    assert "autoscale" in group and "spot" in group and "--spot-trace" in group
    assert " flags " not in group  # the old spelling's command is hidden
    code, autoscale, _ = run("simulate", "autoscale", "--help")
    assert code == 0
    for option in ("--trace", "--burst", "--engine", "--target-qps", "--policy", "--plot"):
        assert option in autoscale, option
    assert "--spot-trace" not in autoscale and "--overprovision" not in autoscale
    code, spot, _ = run("simulate", "spot", "--help")
    assert code == 0
    for option in ("SPOT_TRACE", "--target", "--overprovision", "--seeds", "--trace"):
        assert option in spot, option
    assert "--engine" not in spot and "--burst" not in spot
    code, top, _ = run("--help")
    assert code == 0 and "simulate" in top


def test_simulate_alone_shows_the_subcommands() -> None:
    code, stdout, stderr = run("simulate")
    assert code == 2 and "autoscale" in stdout + stderr and "spot" in stdout + stderr


def test_an_unknown_option_of_the_old_spelling_reads_as_simulate_s_own() -> None:
    code, _, stderr = run("simulate", "--trace", "maf1", "--bogus")
    assert code == 2 and "No such option: --bogus" in stderr
    assert " simulate [OPTIONS]" in stderr and "flags" not in stderr  # the hidden command
