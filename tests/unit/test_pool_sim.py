"""The pool simulator: every job runs once, the autoscalers differ as documented, and the
CLI refuses what would hang or mislead."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.sim.pools import burst_arrivals, simulate_pool, trace_arrivals
from fleetserve.sim.simulator import Trace


def test_every_job_runs_once_and_a_fixed_pool_never_scales() -> None:
    arrivals = burst_arrivals(10, 1, 0)
    run = simulate_pool(arrivals, "fleetserve", 10, lo=2, hi=2, cold_start=0)
    assert len(run.waits or []) == 10 and run.peak_workers == 2
    assert run.makespan == pytest.approx(50, abs=2)  # 5 waves of 10 s on 2 workers


def test_fleetserve_jumps_to_the_queue_where_skyserve_adds_one_worker_per_delay() -> None:
    arrivals = burst_arrivals(60, 1, 0)
    ours = simulate_pool(arrivals, "fleetserve", 60, hi=10, upscale_delay=60, cold_start=60)
    theirs = simulate_pool(arrivals, "skyserve", 60, hi=10, upscale_delay=60, cold_start=60)
    assert ours.peak_workers == theirs.peak_workers == 10
    assert ours.mean_wait < 0.6 * theirs.mean_wait
    assert ours.makespan < theirs.makespan
    assert ours.worker_seconds < theirs.worker_seconds  # and it scales back down sooner


def test_trace_arrivals_follow_the_rate() -> None:
    trace = Trace("t", 60.0, (0.0, 10.0, 0.0))
    arrivals = trace_arrivals(trace, 0.1, seed=1)
    assert all(60 <= a < 120 for a in arrivals)
    assert 30 <= len(arrivals) <= 90  # about 10 x 0.1 x 60


@pytest.mark.parametrize(
    "args",
    [
        ["--burst-jobs", "0"],
        ["--job-seconds", "0"],
        ["--min-workers", "5", "--max-workers", "2"],
        ["--threshold", "0"],
        ["--upscale-delay", "nan"],
        ["--burst-jobs", "100000", "--bursts", "100"],
        ["--trace", "maf1", "--jobs-per-request", "1"],
    ],
)
def test_the_pool_simulator_refuses_bad_settings(args: list[str]) -> None:
    result = CliRunner().invoke(app, ["pool", "simulate", *args])
    assert result.exit_code == 2, result.output
