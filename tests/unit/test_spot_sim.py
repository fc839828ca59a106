"""The spot simulator (fleetserve.sim.spot) on small hand-made traces, the shipped traces'
loading, and `fleetserve simulate --spot-trace` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.sim.spot import ALL_POLICIES, SpotTrace, load_spot_trace, simulate_spot

HOUR = 3600


def _trace(**zones: list[int]) -> SpotTrace:
    return SpotTrace("AWS-test", HOUR, {z: tuple(v) for z, v in zones.items()})


def test_all_on_demand_costs_one_and_the_optimum_bounds_every_policy() -> None:
    tr = _trace(a=[1, 1, 0, 0, 1, 1], b=[1, 0, 0, 1, 1, 1], c=[1, 1, 1, 1, 0, 1])
    runs = {p: simulate_spot(tr, p, target=2, cold_start=300) for p in ALL_POLICIES}
    assert runs["on_demand"].relative_cost == pytest.approx(1.0, rel=0.01)
    assert runs["on_demand"].preemptions == 0
    best = runs["optimum"]
    assert best.availability == 1.0
    for name, r in runs.items():
        assert r.relative_cost >= best.relative_cost - 1e-9, name
        assert r.availability <= 1.0


def test_a_zone_that_loses_capacity_preempts_and_on_demand_fills_in() -> None:
    # Two zones with room for one each, then a loses it for two hours.
    tr = _trace(a=[1, 0, 0, 1, 1, 1], b=[1, 1, 1, 1, 1, 1])
    r = simulate_spot(tr, "dynamic_fallback", target=1, cold_start=60)
    assert r.preemptions >= 1
    assert r.od_seconds > 0  # the lost spare's place was taken by on-demand meanwhile
    assert r.availability > 0.95  # the spare in b kept the target READY


def test_no_spot_at_all_means_on_demand_prices_and_failed_launches() -> None:
    tr = _trace(a=[0, 0, 0], b=[0, 0, 0])
    r = simulate_spot(tr, "adaptive", target=2, cold_start=60)
    assert r.relative_cost == pytest.approx(1.0, rel=0.05)
    assert r.failed_launches >= 1 and r.preemptions == 0
    assert r.spot_seconds == 0


def test_a_target_that_follows_the_load() -> None:
    tr = _trace(a=[4] * 6, b=[4] * 6)
    r = simulate_spot(tr, "adaptive", target=lambda t: 1 if t < 3 * HOUR else 3, cold_start=60)
    flat = simulate_spot(tr, "adaptive", target=3, cold_start=60)
    assert r.cost < flat.cost  # fewer replicas for half the time


def test_the_shipped_traces_load_and_bad_ones_are_named(tmp_path: Path) -> None:
    aws3 = load_spot_trace("AWS3")
    assert len(aws3.zones) == 9 and aws3.step == 300 and aws3.seconds > 60 * 86400
    assert len(load_spot_trace("GCP1", duration=3600).capacity["us-central1-a"]) == 24
    with pytest.raises(ValueError, match=r"no \*\.json zone files"):
        load_spot_trace(str(tmp_path))
    (tmp_path / "z1_x.json").write_text('{"metadata": {"gap_seconds": 60}, "data": [1, 2]}')
    (tmp_path / "z2_x.json").write_text('{"metadata": {"gap_seconds": 30}, "data": [1]}')
    with pytest.raises(ValueError, match="different gap_seconds"):
        load_spot_trace(str(tmp_path))
    (tmp_path / "z2_x.json").write_text('{"data": [1]}')
    with pytest.raises(ValueError, match=r"z2_x\.json: expected"):
        load_spot_trace(str(tmp_path))


def test_simulate_spot_trace_cli_prints_every_policy_as_json_and_refuses_bad_input() -> None:
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["simulate", "--spot-trace", "GCP1", "--duration", "21600", "--seeds", "2", "--json"],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [p["policy"] for p in doc["policies"]] == list(ALL_POLICIES)
    assert doc["policies"][0]["relative_cost"] == pytest.approx(1.0, rel=0.01)
    bad = runner.invoke(app, ["simulate", "--spot-trace", "nowhere"])
    assert bad.exit_code == 2 and "spot trace nowhere" in bad.output
    bad = runner.invoke(app, ["simulate", "--spot-trace", "GCP1", "--policy", "magic"])
    assert bad.exit_code == 2 and "unknown policy 'magic'" in bad.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--start", "-100"], "--start -100.0"),
        (["--start", "inf"], "--start inf"),
        (["--start", "1e9"], "nothing left to replay"),
        (["--duration", "0"], "--duration 0.0"),
        (["--policy", ","], "names no policy"),
        (["--target", "1000"], "--target 1..100"),
        (["--cold-start", "-5"], "--cold-start -5.0"),
        (["--plot", "/nonexistent/x.png"], "not a file in an existing folder"),
        (["--plot", "/tmp"], "name a .png, .svg or .pdf file"),
        (["--trace", "maf1", "--min", "5", "--max", "2"], "--min <= --max"),
    ],
)
def test_simulate_spot_trace_refuses_what_would_mislead_or_hang(args: list[str], says: str) -> None:
    res = CliRunner().invoke(app, ["simulate", "--spot-trace", "GCP1", *args])
    assert res.exit_code == 2 and says in res.output, res.output


def test_a_trace_that_would_never_end_or_block_is_refused(tmp_path: Path) -> None:
    import os

    (tmp_path / "a.json").write_text('{"metadata": {"gap_seconds": 1e300}, "data": [1, 2]}')
    with pytest.raises(ValueError, match="at most a day"):
        load_spot_trace(str(tmp_path))
    (tmp_path / "a.json").unlink()
    os.mkfifo(tmp_path / "x.json")  # reading it would block for ever
    with pytest.raises(ValueError, match="not a regular file"):
        load_spot_trace(str(tmp_path))
    (tmp_path / "x.json").unlink()
    (tmp_path / "b.json").write_text('{"metadata": {"gap_seconds": 60}, "data": []}')
    with pytest.raises(ValueError, match="non-empty list"):
        load_spot_trace(str(tmp_path))
