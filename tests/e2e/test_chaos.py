"""Chaos: kill -9 the controller at random points of up, update, scale and down, again and
again, then check the invariants: the fleet converges, no process is orphaned, no replica id
is used twice, no row is lost, no two services share a port.

CI runs the fixed seeds below plus one random seed. `FLEETSERVE_CHAOS_SEED=N` runs seed N
alone; `FLEETSERVE_CHAOS_SOAK=N` runs N random seeds (one test each, bounded in time by
`FLEETSERVE_CHAOS_BUDGET` seconds, default 3,600: the seeds past it are skipped) and
`FLEETSERVE_CHAOS_ROUNDS` sets the rounds per seed (default 8), `FLEETSERVE_CHAOS_TIMEOUT` the
seconds one seed may take in all (default 600). `FLEETSERVE_CHAOS_REPORT=PATH` appends one JSON
line per seed (seed, rounds, converged, seconds to converge after the last restart, wall
seconds, the error of a failed seed). See the README's test section.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUNDS = int(os.environ.get("FLEETSERVE_CHAOS_ROUNDS", "8"))
CONVERGE_SECONDS = 180.0  # from the last restart to the wanted fleet
# Fixed seeds: 489481 sends a scale while the same service's rollout, cut short by the previous
# kill, is still going (refused by design; issue #28: the test had counted it as accepted);
# 2024 takes both services down, one of them twice, and brings one back under the same name.
FIXED_SEEDS = (489481, 2024)
SOAK = int(os.environ.get("FLEETSERVE_CHAOS_SOAK", "0"))
BUDGET = float(os.environ.get("FLEETSERVE_CHAOS_BUDGET", "3600"))
REPORT = os.environ.get("FLEETSERVE_CHAOS_REPORT")
TIMEOUT = float(os.environ.get("FLEETSERVE_CHAOS_TIMEOUT", "600"))  # per seed, all of it
_STARTED = time.monotonic()


def _seeds() -> list[int]:
    if os.environ.get("FLEETSERVE_CHAOS_SEED"):
        return [int(os.environ["FLEETSERVE_CHAOS_SEED"])]
    # Parallel workers (pytest-xdist) must collect the same seeds: the random ones are drawn
    # from the run's id, which every worker of one run shares; a run alone draws afresh.
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    draw = random.Random(run_id) if run_id else random.Random()
    if SOAK > 0:
        return [draw.randrange(1, 10**6) for _ in range(SOAK)]
    return [*FIXED_SEEDS, draw.randrange(1, 10**6)]


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


def background(fleet: Fleet, out: Path, *args: str) -> subprocess.Popen[str]:
    """The CLI in the background, its output kept in `out` (the round's record)."""
    with out.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "fleetserve", *args],
            env=fleet.env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
        )


def rows(fleet: Fleet) -> tuple[list[tuple[str, int | None]], list[tuple[str, int, str, str]]]:
    with sqlite3.connect(fleet.home / "fleetserve.db") as db:
        services = db.execute("SELECT name, lb_port FROM services").fetchall()
        replicas = db.execute(
            "SELECT service, replica_id, status, launch_token FROM replicas"
        ).fetchall()
    return services, replicas


def accepted(fleet: Fleet) -> dict[str, tuple[str, int | None]]:
    """What the store says each service was last told: its phase and the GENERATION of its
    active version (the facts a killed CLI could not report)."""
    out: dict[str, tuple[str, int | None]] = {}
    with sqlite3.connect(fleet.home / "fleetserve.db") as db:
        for name, phase, yaml_text in db.execute(
            "SELECT s.name, s.phase, v.yaml_text FROM services s JOIN versions v "
            "ON v.service = s.name AND v.version = s.active_version"
        ):
            m = re.search(r'GENERATION: "(\d+)"', yaml_text)
            out[name] = (phase, int(m.group(1)) if m else None)
    return out


@dataclass
class Chaos:
    """One seed's record: the rounds as sent and as the controller took them."""

    seed: int
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line)


def fleet_at_deadline(fleet: Fleet, chaos: Chaos) -> str:
    """What the fleet looked like when convergence timed out: each service's versions and
    replicas, its last events, the rows as stored and the controller log's tail."""
    out = [*chaos.lines, "the fleet at the deadline:"]
    try:
        with fleet.client() as client:
            for svc in client.status():
                out.append(
                    f"service {svc.name}: {svc.status}, active version {svc.active_version}, "
                    f"serving {svc.serving_version}, mode {svc.update_mode}, target "
                    f"{svc.target_replicas}, failure: {svc.failure_reason}"
                )
                for r in svc.replicas:
                    out.append(f"  replica {r.replica_id} v{r.version} {r.status} {r.reason or ''}")
                out.append("  last events:")
                for e in client.events(svc.name, 25):
                    who = f"replica {e.replica_id}: " if e.replica_id is not None else ""
                    at = time.strftime("%H:%M:%S", time.localtime(e.at))
                    out.append(f"    {at} {e.kind} {who}{e.message}")
    except Exception as e:  # the API is down: the store still tells
        out.append(f"(the API did not answer: {e})")
    with sqlite3.connect(fleet.home / "fleetserve.db") as db:
        for row in db.execute(
            "SELECT name, phase, active_version, stable_version, update_mode, launch_stop, "
            "lb_error, cleanup_error "
            "FROM services"
        ):
            out.append(f"row service {row}")
        for row in db.execute(
            "SELECT service, replica_id, version, status, reason FROM replicas "
            "ORDER BY service, replica_id"
        ):
            out.append(f"row replica {row}")
    log = fleet.home / "logs" / "controller.log"
    if log.exists():
        out.append("controller log (tail):")
        out.extend(log.read_text(errors="replace").splitlines()[-30:])
    return "\n".join(out)


def take_round(
    chaos: Chaos,
    fleet: Fleet,
    wanted: dict[str, int],
    sent: tuple[str, str, int, int],
    proc: subprocess.Popen[str],
    out: Path,
) -> None:
    """Set `wanted` from what the controller accepted: a CLI killed with its controller, or
    refused (an update while the service is still rolling out is refused, by design), changes
    nothing; the store is the judge, and it must agree with what the CLI said."""
    what, name, generation, size = sent
    said = out.read_text(errors="replace").strip().splitlines()
    said_line = said[-1] if said else ""
    phase, active = accepted(fleet).get(name, (None, None))
    if what == "down":
        took = phase is None or phase == "SHUTTING_DOWN"
        if took:
            wanted.pop(name, None)
    else:
        took = active == generation
        if took:
            wanted[name] = size
    if proc.returncode == 0:
        assert took, f"the CLI's {what} of {name} succeeded but the store lacks it"
    if "still rolling out" in said_line:
        assert not took, f"the {what} of {name} was refused but the store has it"
    verdict = "accepted" if took else "not accepted"
    chaos.say(f"  {verdict} (CLI exit {proc.returncode}: {said_line[:160]})")


def run_chaos(fleet: Fleet, seed: int) -> float:
    """The rounds of one seed, then the checks; returns the seconds the fleet took to
    converge after the last restart."""
    rng = random.Random(seed)
    chaos = Chaos(seed)
    chaos.say(f"\nchaos seed {seed} (FLEETSERVE_CHAOS_SEED={seed} reruns it), {ROUNDS} rounds")
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
        out = fleet.home.parent / f"round-{round_no}.out"
        proc: subprocess.Popen[str] | None = None
        if action == "up":
            up_again(fleet, str(path), name)
            wanted[name] = replicas
        elif action in ("update", "scale"):
            proc = background(fleet, out, "update", "-d", name, str(path))
        else:
            proc = background(fleet, out, "down", name)
        delay = rng.uniform(0.0, 2.5)
        chaos.say(f"round {round_no}: {action} {name} -> {replicas}; kill -9 after {delay:.2f} s")
        time.sleep(delay)
        kill_controller(fleet)
        if proc is not None:
            proc.wait(timeout=120)  # the CLI fails (its controller died) or was answered
        fleet.cli("server", "start")
        if proc is not None:
            take_round(chaos, fleet, wanted, (action, name, generation, replicas), proc, out)
    restarted = time.monotonic()
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

    chaos.say(f"wanted: {wanted}")
    try:
        fleet.wait_for(f"convergence to {wanted}", converged, timeout=CONVERGE_SECONDS)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{fleet_at_deadline(fleet, chaos)}") from None
    took = time.monotonic() - restarted
    chaos.say(f"converged {took:.1f} s after the last restart")
    services, replica_rows = rows(fleet)
    assert {s for s, _ in services} == set(wanted)
    ports = [p for _, p in services]
    assert len(ports) == len(set(ports))  # no two services share a port
    keys = [(s, r) for s, r, _, _ in replica_rows]
    assert len(keys) == len(set(keys))
    events = sqlite3.connect(fleet.home / "fleetserve.db").execute(
        "SELECT service, replica_id FROM events WHERE message = 'replica created'"
    )
    created = [tuple(e) for e in events]
    assert len(created) == len(set(created)), "a replica id was used twice"
    # No orphan: every replica process of this home carries the token of a row, every LB
    # process is its service's LB (or one of its workers).
    tokens = {t for _, _, _, t in replica_rows}
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
    return took


@pytest.fixture(scope="module")
def soak_summary() -> Iterator[list[dict[str, object]]]:
    results: list[dict[str, object]] = []
    yield results
    if len(results) > 1:
        done = [r for r in results if r["converged"]]
        worst = max((float(str(r["seconds"])) for r in done), default=0.0)
        print(
            f"\nchaos: {len(results)} seeds run, {len(done)} converged, worst convergence "
            f"{worst:.1f} s (bound {CONVERGE_SECONDS:g} s), {ROUNDS} rounds each"
        )
        for r in results:
            if not r["converged"]:
                print(f"chaos: seed {r['seed']} failed: {r.get('error')}")


# The rounds (a few seconds each, up to a minute on a machine at load 17) and the 180 s bound:
# the suite's 300 s per test would cut a slow seed short before its convergence report.
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", _seeds())
def test_kill_9_at_random_points_then_the_fleet_converges(
    fleet: Fleet, seed: int, soak_summary: list[dict[str, object]]
) -> None:
    if SOAK > 0 and time.monotonic() - _STARTED > BUDGET:
        pytest.skip(f"past the soak's budget of {BUDGET:g} s (FLEETSERVE_CHAOS_BUDGET)")
    result: dict[str, object] = {"seed": seed, "rounds": ROUNDS, "converged": False}
    began = time.monotonic()
    try:
        result["seconds"] = round(run_chaos(fleet, seed), 2)
        result["converged"] = True
    except BaseException as e:  # recorded (a timeout of the rounds is not one to converge)
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise
    finally:
        result["wall"] = round(time.monotonic() - began, 1)  # rounds, convergence and checks
        soak_summary.append(result)
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(json.dumps(result) + "\n")


def test_server_start_waits_for_a_busy_controller_instead_of_failing(fleet: Fleet) -> None:
    """A controller that answers its health check late (busy adopting its fleet on a loaded
    machine; stopped here) is the running one: `server start` waits for it and says so,
    instead of starting another that its lock refuses (exit 1) or that it reports as started
    with the pid of that refused process (#28: a risk of the chaos test's restarts)."""
    fleet.cli("server", "start")
    pid = fleet.controller_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        start = subprocess.Popen(
            [sys.executable, "-m", "fleetserve", "server", "start"],
            env=fleet.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # Once the CLI's health check has reached the stopped controller, past its 2 s.
        port = int(fleet.env["FLEETSERVE_API_PORT"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            c.raddr and c.raddr.port == port
            for c in psutil.Process(start.pid).net_connections(kind="tcp")
        ):
            time.sleep(0.05)
        time.sleep(3)
    finally:
        os.kill(pid, signal.SIGCONT)
    said, _ = start.communicate(timeout=60)
    assert start.returncode == 0 and "already running" in said, said
    assert fleet.controller_pid() == pid
