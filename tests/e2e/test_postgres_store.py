"""A fleet whose store is PostgreSQL (FLEETSERVE_DB_URL, tests/pg.py's server): a start with
a wrong password is refused in one line; then up, READY, a request through the endpoint, a
controller restart that adopts the replicas without relaunching them, and down."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from urllib.parse import quote

import psycopg
import pytest

from tests.e2e.conftest import Fleet, endpoint_of
from tests.pg import PASSWORD, PgCluster

pytestmark = pytest.mark.e2e

SERVICE = """\
    name: pgsvc
    service:
      readiness_probe: /health
      replicas: 2
      load_balancing_policy: round_robin
    workdir: {workdir}
    run: python3 server.py
"""


def get(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return dict(json.loads(r.read()))


def rows(url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql.encode()).fetchall())


def test_a_fleet_on_postgres_survives_a_controller_restart(
    fleet: Fleet, pg_cluster: PgCluster, pg_url: str
) -> None:
    database = pg_url.rsplit("/", 1)[1]
    wrong = {**fleet.env, "FLEETSERVE_DB_URL": pg_cluster.url(database, password="nope-pw")}
    refused = subprocess.run(
        [sys.executable, "-m", "fleetserve", "server", "start"],
        env=wrong,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 6 and len(lines) == 1, refused.stderr
    assert "refused the login of user 'fleet'" in lines[0] and "***" in lines[0]
    assert "nope-pw" not in refused.stderr + refused.stdout
    assert not (fleet.home / "server.json").exists()

    fleet.env["FLEETSERVE_DB_URL"] = pg_url
    path = fleet.write_service("pgsvc", SERVICE.format(workdir=fleet.workdir))
    endpoint = endpoint_of(fleet.cli("up", str(path)).stdout)
    fleet.wait_for(
        "2 READY replicas",
        lambda: [r.status for r in fleet.client().service("pgsvc").replicas] == ["READY"] * 2,
        30,
    )
    assert get(f"{endpoint}/hello")["path"] == "/hello"
    with fleet.client() as c:
        before = {r.replica_id: r.pid for r in c.service("pgsvc").replicas}
    assert not (fleet.home / "fleetserve.db").exists()  # every row is in PostgreSQL
    url = pg_cluster.url(database)
    assert rows(url, "SELECT name FROM services") == [("pgsvc",)]
    log = (fleet.home / "logs" / "controller.log").read_text()
    assert "store postgresql+psycopg://fleet:***@127.0.0.1" in log
    assert PASSWORD not in log and quote(PASSWORD, safe="") not in log

    fleet.cli("server", "stop")
    assert get(f"{endpoint}/while-down")["path"] == "/while-down"  # the LB keeps serving
    fleet.cli("server", "start")

    def adopted() -> bool:
        with fleet.client() as c:
            events = [e.message for e in c.events("pgsvc")]
        return sum("adopted after controller restart" in m for m in events) == 2

    fleet.wait_for("both replicas adopted", adopted, 30)
    with fleet.client() as c:
        after = c.service("pgsvc")
    assert {r.replica_id: r.pid for r in after.replicas} == before  # adopted, not relaunched
    assert all(r.status == "READY" for r in after.replicas)
    served = {get(f"{endpoint}/after")["replica"] for _ in range(4)}
    assert served == {"1", "2"}

    fleet.cli("down", "pgsvc")
    assert rows(url, "SELECT count(*) FROM services") == [(0,)]
    assert rows(url, "SELECT count(*) FROM replicas") == [(0,)]
