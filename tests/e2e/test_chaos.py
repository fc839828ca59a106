"""Chaos: kill -9 the controller at random points of up, update, scale and down, again and
again, then check the invariants: the fleet converges, no process is orphaned, no replica id
is used twice, no row is lost, no two services share a port."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time

import psutil
import pytest

from tests.e2e.conftest import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUNDS = 8
SEED = int(os.environ.get("FLEETSERVE_CHAOS_SEED", "0")) or random.randrange(1, 10**6)

SPEC = """\
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replicas: {replicas}
    workdir: {workdir}
    run: python3 server.py
    envs:
      GENERATION: "{generation}"
"""


def kill_controller(fleet: Fleet) -> None:
    pid = fleet.controller_pid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)


def up_again(fleet: Fleet, path: str, name: str) -> None:
    """`up -d`, waiting while an earlier `down` of the same name is still finishing."""
    deadline = time.monotonic() + 90
    while True:
        proc = fleet.cli("up", "-d", path, "-n", name, check=False)
        if proc.returncode == 0:
            return
        assert "still shutting down" in proc.stderr and time.monotonic() < deadline, proc.stderr
        time.sleep(0.5)


def rows(fleet: Fleet) -> tuple[list[tuple[str, int | None]], list[tuple[str, int, str, str]]]:
    with sqlite3.connect(fleet.home / "fleetserve.db") as db:
        services = db.execute("SELECT name, lb_port FROM services").fetchall()
        replicas = db.execute(
            "SELECT service, replica_id, status, launch_token FROM replicas"
        ).fetchall()
    return services, replicas


def test_kill_9_at_random_points_then_the_fleet_converges(fleet: Fleet) -> None:
    rng = random.Random(SEED)
    print(f"\nchaos seed {SEED} (FLEETSERVE_CHAOS_SEED reruns it)")
    fleet.cli("server", "start")
    wanted: dict[str, int] = {}  # service -> replicas it should converge to
    for round_no in range(ROUNDS):
        generation = round_no + 1
        name = rng.choice(["alpha", "beta"])
        if name not in wanted:
            action, replicas = "up", rng.choice([1, 2])
        else:
            action = rng.choice(["update", "scale", "down"])
            replicas = wanted[name] if action == "update" else rng.choice([1, 2, 3])
        body = SPEC.format(replicas=replicas, workdir=fleet.workdir, generation=generation)
        path = fleet.write_service(f"{name}-{generation}", body)
        if action == "up":
            up_again(fleet, str(path), name)
            wanted[name] = replicas
        elif action in ("update", "scale"):
            proc = fleet.cli_background("update", name, str(path))
            wanted[name] = replicas
        else:
            proc = fleet.cli_background("down", name)
            del wanted[name]
        delay = rng.uniform(0.0, 2.5)
        print(f"round {round_no}: {action} {name} -> {replicas}; kill -9 after {delay:.2f} s")
        time.sleep(delay)
        kill_controller(fleet)
        if action != "up":
            proc.wait(timeout=120)  # the CLI fails (its controller died) or finished
        fleet.cli("server", "start")
    # Converge: every wanted service READY at its size, every other one gone.
    client = fleet.client()

    def converged() -> bool:
        names = {s.name: s for s in client.status()}
        if set(names) != set(wanted):
            return False
        for n, size in wanted.items():
            svc = names[n]
            ready = [r for r in svc.replicas if r.status == "READY"]
            live = [r for r in svc.replicas if r.status not in ("FAILED",)]
            rolling = svc.active_version != svc.serving_version
            if len(ready) != size or len(live) != size or rolling:
                return False
        return True

    fleet.wait_for(f"convergence to {wanted}", converged, timeout=180)
    services, replicas = rows(fleet)
    assert {s for s, _ in services} == set(wanted)
    ports = [p for _, p in services]
    assert len(ports) == len(set(ports))  # no two services share a port
    keys = [(s, r) for s, r, _, _ in replicas]
    assert len(keys) == len(set(keys))
    events = sqlite3.connect(fleet.home / "fleetserve.db").execute(
        "SELECT service, replica_id FROM events WHERE message = 'replica created'"
    )
    created = [tuple(e) for e in events]
    assert len(created) == len(set(created)), "a replica id was used twice"
    # No orphan: every replica process of this home carries the token of a row, every LB
    # process is its service's LB (or one of its workers).
    tokens = {t for _, _, _, t in replicas}
    for s, port in services:  # each remaining service's LB serves on its reserved port
        assert json.loads((fleet.home / "lb" / f"{s}.json").read_text())["port"] == port
    for p in fleet.processes():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        token = env.get("FLEETSERVE_LAUNCH_TOKEN")
        if token is not None:
            assert token in tokens, f"orphan replica process {p.pid} {p.cmdline()}"
        lb = env.get("FLEETSERVE_LB_SERVICE")
        if lb is not None:
            assert lb in wanted, f"orphan load balancer {p.pid} of {lb}"
