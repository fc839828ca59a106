"""End to end: the controller's /metrics (behind the API token) shows a real fleet, the load
balancer's /metrics its traffic, and every metric the Grafana dashboard queries exists in one
of them (docs/metrics.md)."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "fleetserve.json"
LB_JOBS = ROOT / "examples" / "prometheus" / "lb_scrape_configs.py"
SERVICE = """\
    name: {name}
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replicas: 2
    workdir: {workdir}
    run: python3 server.py
"""
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def fetch(url: str, token: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, 4xx included."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def scrape(url: str, token: str) -> tuple[Samples, set[str]]:
    """The samples of a /metrics answer, and every name a query may use: families (with the
    suffixes of their type, so a counter with no sample yet counts) and samples."""
    status, ctype, text = fetch(url, token)
    assert status == 200 and ctype == CONTENT_TYPE_LATEST, (status, ctype, text[:300])
    samples: Samples = {}
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(fam.name + s for s in suffixes.get(fam.type, ()))
        for s in fam.samples:
            names.add(s.name)
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the samples that carry `labels` (and any others)."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all((k, x) in ls for k, x in labels.items())
    )


def dashboard_metrics() -> set[str]:
    """The metric names the dashboard's queries (panels and variables) use."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var.get("query")
        exprs.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return {m for e in exprs for m in re.findall(r"\bfleetserve_[a-z0-9_]+", e)}


def test_metrics_of_a_live_fleet_and_the_dashboards_queries(fleet: Fleet, tmp_path: Path) -> None:
    name = "watched"
    path = fleet.write_service(name, SERVICE.format(name=name, workdir=fleet.workdir))
    endpoint = endpoint_of(fleet.cli("up", str(path), timeout=40).stdout)

    def two_ready() -> bool:
        with fleet.client() as c:
            return sum(r.status == "READY" for r in c.service(name).replicas) == 2

    fleet.wait_for("2 READY replicas", two_ready, timeout=30)
    for i in range(10):
        with urllib.request.urlopen(f"{endpoint}/req/{i}", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["path"] == f"/req/{i}"

    # The controller: the API token, like every route but /api/v1/health.
    metrics = fleet.api.removesuffix("/api/v1") + "/metrics"
    token = fleet.auth()["Authorization"].removeprefix("Bearer ")
    assert fetch(metrics)[0] == 401
    assert fetch(metrics, "not-the-token")[0] == 401
    ctl, ctl_names = scrape(metrics, token)
    svc = {"service": name}
    assert value(ctl, "fleetserve_controller_replicas", **svc, status="READY") == 2
    assert value(ctl, "fleetserve_controller_replicas", **svc, status="FAILED") == 0
    assert value(ctl, "fleetserve_controller_ready_replicas", **svc) == 2
    assert value(ctl, "fleetserve_controller_target_replicas", **svc) == 2
    assert value(ctl, "fleetserve_controller_service_status", **svc, status="READY") == 1
    assert value(ctl, "fleetserve_controller_version_ready_replicas", **svc, version="1") == 2
    launches = value(ctl, "fleetserve_controller_replica_launches_total", **svc, kind="on_demand")
    assert launches == 2
    assert value(ctl, "fleetserve_controller_replica_transitions_total", **svc, status="READY") == 2
    assert total(ctl, "fleetserve_controller_replica_failures_total", **svc) == 0
    assert (value(ctl, "fleetserve_controller_probes_total", **svc, outcome="ok") or 0) >= 2
    assert (value(ctl, "fleetserve_controller_reconcile_duration_seconds_count", **svc) or 0) >= 1

    # The load balancer: its admin port and secret are in its config file (the owner's only).
    lb = json.loads((fleet.home / "lb" / f"{name}.json").read_text())
    admin = f"http://127.0.0.1:{lb['admin_port']}/metrics"
    assert fetch(admin)[0] == 401
    traffic, lb_names = scrape(admin, lb["admin_secret"])
    assert total(traffic, "fleetserve_lb_requests_total", **svc, code="200") >= 10
    assert total(traffic, "fleetserve_lb_request_duration_seconds_count", **svc) >= 10

    # Every metric the dashboard queries is served by one or the other.
    used = dashboard_metrics()
    assert {n for n in used if n.startswith("fleetserve_controller_")}, used
    assert {n for n in used if n.startswith("fleetserve_lb_")}, used
    missing = used - ctl_names - lb_names
    assert not missing, f"the dashboard queries metrics nobody serves: {sorted(missing)}"

    # The example that writes Prometheus jobs for the load balancers (docs/metrics.md).
    out = tmp_path / "prometheus"
    subprocess.run(
        [sys.executable, str(LB_JOBS), "--home", str(fleet.home), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    (job,) = json.loads((out / "lb-scrape-configs.yml").read_text())["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"127.0.0.1:{lb['admin_port']}"]}]
    secret = Path(job["authorization"]["credentials_file"])
    assert secret.read_text() == lb["admin_secret"]
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600

    # A service taken down leaves no series behind.
    fleet.cli("down", name, "--purge", timeout=40)
    after, _ = scrape(metrics, token)
    assert not [key for key in after if ("service", name) in key[1]]
    assert value(after, "fleetserve_controller_services") == 0
