"""Processes that clear their environment and leave their session (setsid, a double fork,
nohup, a daemon) through the real CLI and controller: a job's go at `jobs cancel`, at the
job's end and at `pool down`; a replica's at `down`, after a `kill -9` and restart of the
controller; nothing is left in the cgroup hierarchy (docs/security.md, docs/pools.md)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet
from tests.escapees import SHAPES, Escapees, escapees, escaping

__all__ = ["escapees"]  # the fixture

pytestmark = pytest.mark.e2e


def home_cgroup(fleet: Fleet) -> Path:
    """The home's cgroup, as `server status` names it (cgroups are used on this machine)."""
    out = fleet.cli("server", "status").stdout
    m = re.search(r"Local replicas and jobs: cgroup v2: .* under (\S+)", out)
    assert m, out
    return Path(m.group(1))


def job_yaml(fleet: Fleet, name: str, pids: Path, tail: str) -> Path:
    run = escaping(pids, tail).replace("\n", "\n  ")
    path = fleet.home.parent / f"{name}.yaml"
    path.write_text(f"run: |\n  {run}\n")
    return path


@pytest.mark.slow  # 15 to 21 s: a pool, three jobs, cancel, down
def test_a_jobs_escaped_processes_go_at_cancel_at_its_end_and_at_pool_down(
    fleet: Fleet, escapees: Escapees
) -> None:
    tmp = fleet.home.parent
    pool = tmp / "pool.yaml"
    pool.write_text(f"pool:\n  workers: 1\nworkdir: {fleet.workdir}\n")
    fleet.cli("pool", "apply", "-p", "batch", str(pool))
    client = fleet.client()
    fleet.wait_for(
        "a READY worker",
        lambda: any(r.status == "READY" for r in client.pools("batch")[0].replicas),
    )
    cgroups = home_cgroup(fleet)
    # `jobs cancel`
    fleet.cli(
        "jobs", "launch", "-p", "batch", str(job_yaml(fleet, "a", tmp / "a", "exec sleep 300"))
    )
    escapees.collect(tmp / "a")
    fleet.cli("jobs", "cancel", str(client.jobs("batch")[0].job_id))
    assert escapees.wait_gone() == []
    # The job's end: what it left behind is stopped. (It ends 3 s after its escapees wrote
    # their pids, so that the test sees them alive before the job's end stops them.)
    b = tmp / "b"
    files = " && ".join(f"[ -s {b / shape} ]" for shape in SHAPES)
    tail = f"for i in $(seq 400); do {files} && break; sleep 0.05; done; sleep 3; echo ok"
    fleet.cli("jobs", "launch", "-p", "batch", str(job_yaml(fleet, "b", b, tail)))
    escapees.collect(b)
    fleet.wait_for(
        "the job's end", lambda: client.jobs("batch")[1].status == "SUCCEEDED", timeout=60
    )
    assert escapees.wait_gone() == []
    # `pool down` while a job runs.
    fleet.cli(
        "jobs", "launch", "-p", "batch", str(job_yaml(fleet, "c", tmp / "c", "exec sleep 300"))
    )
    escapees.collect(tmp / "c")
    fleet.cli("pool", "down", "batch", "--cancel-jobs")
    assert escapees.wait_gone() == []
    assert len(escapees.seen) == 3 * len(SHAPES)
    fleet.wait_for("the home's cgroups removed", lambda: not cgroups.exists(), timeout=20)


@pytest.mark.slow  # about 20 s: a service up, a controller restart, down
def test_a_replicas_escaped_processes_go_at_down_after_a_controller_restart(
    fleet: Fleet, escapees: Escapees
) -> None:
    pids = fleet.home.parent / "pids"
    run = escaping(pids, "exec python3 server.py").replace("\n", "\n  ")
    service = fleet.home.parent / "svc.yaml"
    service.write_text(
        f"service:\n  readiness_probe: /\n  replicas: 1\nworkdir: {fleet.workdir}\n"
        f"run: |\n  {run}\n"
    )
    fleet.cli("up", str(service), "-n", "svc")
    escapees.collect(pids)
    cgroups = home_cgroup(fleet)
    assert [p.name for p in cgroups.iterdir() if p.name.startswith("r.svc.")]
    os.kill(fleet.controller_pid(), signal.SIGKILL)
    fleet.cli("server", "start")
    fleet.cli("down", "svc")
    assert escapees.wait_gone(timeout=20) == []
    fleet.wait_for("the home's cgroups removed", lambda: not cgroups.exists(), timeout=20)


def test_without_cgroups_status_says_the_token_scan_alone_stops_processes(fleet: Fleet) -> None:
    fleet.env["FLEETSERVE_CGROUPS"] = "bogus"
    refused = fleet.cli("server", "start", check=False)
    assert refused.returncode != 0
    assert "FLEETSERVE_CGROUPS='bogus': use auto or off" in refused.stderr
    assert "Traceback" not in refused.stderr
    fleet.env["FLEETSERVE_CGROUPS"] = "off"
    fleet.cli("server", "start")
    line = "Local replicas and jobs: token scan only (FLEETSERVE_CGROUPS=off)"
    assert line in fleet.cli("server", "status").stdout
    status = " ".join(fleet.cli("status").stdout.split())  # rich wraps long lines
    assert "Local replicas and jobs: stopped by token scan only (FLEETSERVE_CGROUPS=off)" in status
    assert "can outlive its replica or job" in status
