"""The simulator: traces, the fleet model, the three policies, the CLI and its plot."""

from __future__ import annotations

import json
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


def _fleetserve(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_ready_replicas_over_time_shows_means_not_instants(tmp_path: Path) -> None:
    """A trace that alternates 0 and 6 req/s each minute averages 3 req/s: each row of the
    table (and each JSON sample's mean_qps) is 3.0, where instants showed 0.0 throughout."""
    csv = tmp_path / "alt.csv"
    csv.write_text("time_s,qps\n" + "".join(f"{60 * i},{6 * (i % 2)}\n" for i in range(120)))
    proc = _fleetserve("simulate", "--trace", str(csv), "--policy", "request_rate")
    assert proc.returncode == 0, proc.stderr
    assert "mean 3.00 req/s" in proc.stdout
    table = proc.stdout[proc.stdout.index("Ready replicas over time") :]
    rows = [line.split("│")[1:-1] for line in table.splitlines() if " h " in line]
    assert len(rows) == 12, table
    assert [cell.strip() for _, cell, _ in rows] == ["3.0"] * 12, table
    assert "means over 10 min" in " ".join(table.split())
    doc = _fleetserve("simulate", "--trace", str(csv), "--policy", "request_rate", "-o", "json")
    samples = json.loads(doc.stdout)["samples"]
    assert [s["mean_qps"] for s in samples] == [3.0] * 12
    assert [s["interval_s"] for s in samples] == [600.0] * 12


def test_plot_without_matplotlib_fails_before_the_run_and_names_the_extra(
    tmp_path: Path,
) -> None:
    """No matplotlib: `--plot` is refused at once (not after a spot trace's tens of
    seconds), naming the extra `.[sim]`, without a traceback and without a result table."""
    import os
    import time

    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{shadow.parent}{os.pathsep}{env.get('PYTHONPATH', '')}"
    png = str(tmp_path / "p.png")
    for args in (
        ["--burst", "2:30:900:300", "--duration", "3600"],
        ["--spot-trace", "GCP1", "--duration", "21600", "--seeds", "2"],
    ):
        began = time.monotonic()
        proc = _fleetserve("simulate", *args, "--plot", png, env=env)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "fleetserve[sim]" in proc.stderr and ".[sim]" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stdout == "", proc.stdout  # refused before anything ran
        assert time.monotonic() - began < 30
    assert not Path(png).exists()


def test_a_spot_trace_shows_progress_on_a_terminal() -> None:
    """On a terminal, each run of a spot comparison is announced on stderr as it starts (a
    long trace takes tens of seconds); stdout keeps only the result."""
    import os
    import pty
    import select
    import time

    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "fleetserve", "simulate", "--spot-trace", "GCP1"),
            *("--duration", "21600", "--seeds", "2", "--policy", "even_spread,dynamic_fallback"),
        ],
        stdout=subprocess.PIPE,
        stderr=sub,
        text=True,
    )
    os.close(sub)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1)
        if ready:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    out, _ = proc.communicate(timeout=30)
    text = seen.decode()
    assert proc.returncode == 0, text
    assert "Simulating 3 runs on GCP1" in text, text
    for line in ("[1/3] even_spread", "[2/3] dynamic_fallback (seed 1 of 2)", "[3/3]"):
        assert line in text, text
    assert "[1/3]" not in out and "dynamic_fallback" in out
