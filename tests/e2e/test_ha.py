"""High availability with real processes: two controllers on one home and database
(FLEETSERVE_HA=1), one active, one standby. The standby serves reads and points writes at the
active one (the CLI follows); kill -9 of the active controller under load: the standby takes
over within seconds, adopts the replicas and the load balancer without relaunching any, and
the endpoint fails no request (docs/scaling.md)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter

import httpx
import pytest

from tests.e2e.conftest import Fleet, endpoint_of, free_port

pytestmark = pytest.mark.e2e

SERVICE = """\
name: steady
service:
  readiness_probe: /health
  replicas: 2
workdir: {workdir}
run: python3 server.py
"""


def health(port: int) -> dict[str, object] | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2)
        return dict(r.json())
    except (httpx.HTTPError, ValueError):
        return None


def load(url: str, stop: threading.Event, tally: Counter[str], failures: list[str]) -> None:
    """Bounded: at most 20,000 requests or 90 s."""
    deadline = time.monotonic() + 90
    for _ in range(20_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        try:
            with urllib.request.urlopen(url + "/x", timeout=10) as r:
                tally[json.loads(r.read())["replica"]] += 1
        except Exception as e:  # every failure is kept and fails the test
            failures.append(repr(e))
        time.sleep(0.005)


# PostgreSQL, the store HA is for; the lease and fencing run on SQLite too in the unit tests
# (tests/unit/store/test_leader.py, tests/unit/controller/test_leadership.py).
@pytest.mark.parametrize("database", ["postgresql"])
def test_a_standby_takes_over_when_the_active_controller_is_killed(
    fleet: Fleet, database: str, request: pytest.FixtureRequest
) -> None:
    port_a, port_b = free_port(), free_port()
    fleet.env.update({"FLEETSERVE_HA": "1", "FLEETSERVE_LEASE_TTL": "4"})
    if database == "postgresql":  # a real server of the tests' own (tests/pg.py)
        fleet.env["FLEETSERVE_DB_URL"] = request.getfixturevalue("pg_url")
    env_a = {**fleet.env, "FLEETSERVE_API_PORT": str(port_a)}
    env_b = {**fleet.env, "FLEETSERVE_API_PORT": str(port_b)}
    fleet.env = env_a
    fleet.cli("server", "start")
    fleet.wait_for("A active", lambda: (health(port_a) or {}).get("role") == "active")
    fleet.env = env_b
    fleet.cli("server", "start")
    fleet.wait_for("B answering", lambda: health(port_b) is not None)
    assert (health(port_b) or {}).get("role") == "standby"
    # the same home, one file per controller
    pid_a = json.loads((fleet.home / f"server-{port_a}.json").read_text())["pid"]
    assert (fleet.home / f"server-{port_b}.json").exists()

    # Through the standby: reads answer; a write is pointed at A, and the CLI follows.
    path = fleet.write_service("steady", SERVICE.format(workdir=fleet.workdir))
    endpoint = endpoint_of(fleet.cli("up", str(path), timeout=120).stdout)
    refused = httpx.post(
        f"http://127.0.0.1:{port_b}/api/v1/services/steady/rollback",
        headers=fleet.auth(),
        json={},
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["kind"] == "standby"
    assert refused.json()["error"]["active"].endswith(f":{port_a}")
    listed = fleet.cli("status", "-o", "json").stdout  # a read the standby answers itself
    assert [s["name"] for s in json.loads(listed)] == ["steady"]
    client = fleet.client()
    fleet.wait_for(
        "2 READY", lambda: sum(r.status == "READY" for r in client.service("steady").replicas) == 2
    )
    before = {(r.replica_id, r.pid) for r in client.service("steady").replicas}

    stop, tally, failures = threading.Event(), Counter[str](), []
    traffic = threading.Thread(target=load, args=(endpoint, stop, tally, failures), daemon=True)
    traffic.start()
    try:
        time.sleep(1.0)
        os.kill(pid_a, signal.SIGKILL)
        killed = time.monotonic()
        fleet.wait_for(
            "B active",
            lambda: (health(port_b) or {}).get("role") == "active",
            timeout=20,
        )
        took = time.monotonic() - killed
        # B acts: it answers writes (a missing service: 404 from B itself, not 503)
        gone = fleet.cli("down", "no-such-service", check=False)
        assert gone.returncode == 3, gone.stderr
        time.sleep(3.0)  # traffic goes on through B's first rounds
    finally:
        stop.set()
        traffic.join(timeout=15)
    after = {(r.replica_id, r.pid) for r in client.service("steady").replicas}
    statuses = [r.status for r in client.service("steady").replicas]
    events = [e.message for e in client.events("steady", limit=200)]
    fleet.cli("down", "steady", timeout=120)
    fleet.cli("server", "stop")
    print(
        f"{database}: takeover after kill -9: {took:.1f} s; {sum(tally.values())} requests, "
        f"{len(failures)} failed"
    )
    # the store really was where the test put it
    assert (fleet.home / "fleetserve.db").exists() == (database == "sqlite")
    assert failures == [], failures[:5]
    assert sum(tally.values()) > 100 and len(tally) == 2
    assert after == before and statuses == ["READY", "READY"]  # adopted, none relaunched
    assert sum("replica created" in m for m in events) == 2, events  # none after the first two
    assert any("adopted" in m for m in events), events
    assert not any("load balancer" in m and "replacing" in m for m in events), events  # kept
    assert took < 10.0
