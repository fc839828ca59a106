"""The simulator: traces, the fleet model, the three policies, the CLI and its plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetserve.sim.simulator import (
    Trace,
    burst_trace,
    load_trace,
    policy_for,
    simulate,
)


def policy(name: str, **kw: float) -> object:
    args = {
        "min_replicas": 1,
        "max_replicas": 10,
        "target_qps": 5.0,
        "target_inflight": 5.0,
        "upscale_delay": 60.0,
        "downscale_delay": 120.0,
        "window": 30.0,
    }
    args.update(kw)
    return policy_for(name, **args)  # type: ignore[arg-type]


def test_load_trace_per_minute_and_per_second(tmp_path: Path) -> None:
    maf = load_trace("maf1", duration=600)
    assert maf.step == 60 and len(maf.qps) == 10
    assert maf.qps[0] == pytest.approx(4033 / 60)
    f = tmp_path / "t.csv"
    f.write_text("time_s,qps\n0,1\n10,3\n20,5\n")
    t = load_trace(str(f), scale=2)
    assert t.step == 10 and t.qps == (2.0, 6.0, 10.0) and t.at(15) == 6.0
    f.write_text("time_s,qps\n0,1\nx,2\n")
    with pytest.raises(ValueError, match="line 3"):
        load_trace(str(f))


def test_steady_load_settles_at_rate_over_capacity() -> None:
    trace = Trace("flat", 1.0, (22.0,) * 1200)
    run = simulate(trace, policy("request_rate"), "request_rate", capacity_qps=5, cold_start=30)  # type: ignore[arg-type]
    assert run.ready[-1] == 5  # ceil(22 / 5)
    assert run.over_capacity_requests > 0  # before the upscale delay and cold start passed
    late = sum(max(0.0, q - r * 5) for q, r in zip(run.qps[300:], run.ready[300:], strict=True))
    assert late == 0  # and none once the fleet has grown
    assert run.replica_hours == pytest.approx(sum(run.launched) / 3600)


def test_skyserve_model_reacts_no_sooner_than_its_ticks() -> None:
    trace = burst_trace(1, 40, 10_000, 10_000, 900)  # 40 req/s from the start
    ours = simulate(trace, policy("request_rate"), "request_rate", 5, cold_start=0)  # type: ignore[arg-type]
    sky = simulate(trace, policy("skyserve"), "skyserve", 5, cold_start=0)  # type: ignore[arg-type]
    first = lambda run: next(i for i, r in enumerate(run.ready) if r > 1)  # noqa: E731
    assert first(ours) >= 60  # our delay: 60 s of sustained demand
    assert first(sky) >= 60 and first(sky) % 20 in (0, 1)  # on a 20 s tick


def test_cli_compares_policies_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetserve",
            "simulate",
            "--burst",
            "2:30:900:300",
            "--duration",
            "3600",
            "--upscale-delay",
            "30",
            "--downscale-delay",
            "120",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("request_rate", "in_flight", "skyserve", "REPLICA-HOURS"):
        assert name in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        [sys.executable, "-m", "fleetserve", "simulate", "--burst", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "BASE:PEAK:PERIOD:LENGTH" in bad.stderr
