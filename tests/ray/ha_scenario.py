"""High availability across hosts, run inside a network namespace of the test's own (see
test_ray_ha.py): a real Ray cluster (a head and two worker raylets), a private PostgreSQL
server, and two controllers with homes and host ids of their own (host-a, host-b) on one
database, FLEETSERVE_HA=1. A service on `infra: ray` with two replicas; then host A is lost:
kill -9 of controller A and of its load balancer (the pids the store records). Prints one
JSON line of findings; the test asserts on them.

Run from the repository's root: python -m tests.ray.ha_scenario WORK_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster
from sqlalchemy import create_engine, text

from fleetserve.store.url import normalize_db_url
from tests.pg import start_cluster
from tests.ray.netns import SERVER

PORT_A, PORT_B = 47981, 47982
LB_PORT_START = 35101


def main(work: Path) -> None:
    found: dict[str, Any] = {}
    t_start = time.monotonic()
    pg = start_cluster()
    cluster: Cluster | None = None
    envs: dict[str, dict[str, str]] = {}
    try:
        url = pg.url(pg.new_database("ha"))
        found["pg_started_s"] = round(time.monotonic() - t_start, 1)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        found["ray_started_s"] = round(time.monotonic() - t_start, 1)
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
        base.update(
            FLEETSERVE_HA="1",
            FLEETSERVE_LEASE_TTL="4",
            FLEETSERVE_DB_URL=url,
            FLEETSERVE_RAY_ADDRESS=cluster.address,
            FLEETSERVE_LB_PORT_START=str(LB_PORT_START),
            FLEETSERVE_PROBE_INTERVAL="1",
            FLEETSERVE_TERMINATE_GRACE="2",
        )
        for name, port in (("a", PORT_A), ("b", PORT_B)):
            envs[name] = dict(
                base,
                FLEETSERVE_HOME=str(work / f"home-{name}"),
                FLEETSERVE_HOST_ID=f"host-{name}",
                FLEETSERVE_API_PORT=str(port),
            )
        run(work, found, url, envs)
    finally:
        for name in ("b", "a"):  # whatever still runs; B first (A should be gone)
            if name in envs:
                with contextlib.suppress(Exception):
                    cli(envs[name], "server", "stop", check=False)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        pg.stop()
        shutil.rmtree(pg.root, ignore_errors=True)
    found["total_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(found))


def cli(env: dict[str, str], *args: str, check: bool = True) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "fleetserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and out.returncode != 0:
        raise SystemExit(f"fleetserve {args} failed: {out.stdout}\n{out.stderr}")
    return out.stdout


def health(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/health", timeout=2) as r:
            return dict(json.loads(r.read()))
    except Exception:
        return {}


def wait(what: str, check: Any, timeout: float) -> float:
    """Seconds until `check()` is true; SystemExit after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def get(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return dict(json.loads(r.read()))
    except Exception:
        return None


def run(work: Path, found: dict[str, Any], url: str, envs: dict[str, dict[str, str]]) -> None:
    engine = create_engine(normalize_db_url(url))

    def rows(sql: str) -> list[Any]:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)).all())

    env_a, env_b = envs["a"], envs["b"]
    cli(env_a, "server", "start")
    wait("A active", lambda: health(PORT_A).get("role") == "active", 30)
    # B's home holds A's API token (a copy): clients follow the active controller with it.
    home_b = work / "home-b"
    home_b.mkdir(mode=0o700)
    shutil.copy(work / "home-a" / "api-token", home_b / "api-token")
    (home_b / "api-token").chmod(0o600)
    cli(env_b, "server", "start")
    wait("B answering", lambda: bool(health(PORT_B)), 30)
    found["b_role_before"] = health(PORT_B).get("role")
    # Both controllers run with the database's home id (B joined it: another home path).
    found["home_ids"] = sorted(
        {
            line.split("home id ", 1)[1].split(",", 1)[0]
            for name, port in (("a", PORT_A), ("b", PORT_B))
            for line in (work / f"home-{name}" / "logs" / f"controller-{port}.log")
            .read_text()
            .splitlines()
            if "controller starting on" in line
        }
    )
    found["b_joined"] = (
        "joined the home id" in (work / "home-b" / "logs" / f"controller-{PORT_B}.log").read_text()
    )

    app = work / "app"
    app.mkdir()
    (app / "server.py").write_text(SERVER)
    (work / "svc.yaml").write_text(
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: 60}\n  replicas: 2\n"
        f"resources: {{infra: ray, cpus: 0.5}}\nrun: python3 {app}/server.py\n"
    )
    up_at = time.monotonic()
    cli(env_a, "up", str(work / "svc.yaml"), "-n", "hasvc")

    def ready() -> list[Any]:
        return rows(
            "SELECT replica_id, launch_token, status, handle FROM replicas "
            "WHERE service='hasvc' ORDER BY replica_id"
        )

    wait("2 READY", lambda: [r[2] for r in ready()] == ["READY", "READY"], 90)
    found["ready_after_up_s"] = round(time.monotonic() - up_at, 1)
    before = [(int(r[0]), str(r[1])) for r in ready()]
    actors_before = sorted(json.loads(r[3])["actor"] for r in ready())
    svc = rows("SELECT lb_port, lb_pid, lb_host FROM services WHERE name='hasvc'")[0]
    port, lb_pid, lb_host_a = int(svc[0]), int(svc[1]), svc[2]
    found["lb_host_before"] = lb_host_a
    endpoint = f"http://127.0.0.1:{port}/"
    found["answer_before"] = get(endpoint)
    found["actors_before"] = sorted(named_actors(env_a)) == actors_before

    # Host A is lost: its controller and its load balancer (the pids the store records).
    pid_a = json.loads((work / "home-a" / f"server-{PORT_A}.json").read_text())["pid"]
    victims = [pid_a, lb_pid]
    with contextlib.suppress(psutil.Error):
        victims += [p.pid for p in psutil.Process(lb_pid).children(recursive=True)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    found["endpoint_down_after_kill"] = get(endpoint) is None
    active_after = wait("B active", lambda: health(PORT_B).get("role") == "active", 20)
    found["b_active_after_s"] = round(active_after, 2)
    answering = wait("B's LB answering", lambda: get(endpoint) is not None, 30)
    found["endpoint_back_after_s"] = round(time.monotonic() - killed, 2)
    found["endpoint_back_after_active_s"] = round(answering, 2)
    tally: Counter[str] = Counter()
    failures = 0
    for _ in range(60):
        answer = get(endpoint)
        if answer is None:
            failures += 1
        else:
            tally[str(answer["replica"])] += 1
    found["requests_after"] = sum(tally.values())
    found["request_failures_after"] = failures
    found["replicas_answering_after"] = sorted(tally)
    after = ready()
    found["same_replicas"] = [(int(r[0]), str(r[1])) for r in after] == before
    found["statuses_after"] = [str(r[2]) for r in after]
    found["actors_same"] = sorted(json.loads(r[3])["actor"] for r in after) == actors_before
    svc = rows("SELECT lb_port, lb_pid, lb_host FROM services WHERE name='hasvc'")[0]
    found["lb_port_same"] = int(svc[0]) == port
    found["lb_host_after"] = svc[2]
    found["lb_pid_changed"] = int(svc[1]) != lb_pid
    events = [str(r[0]) for r in rows("SELECT message FROM events WHERE service='hasvc'")]
    found["replicas_created"] = sum("replica created" in m for m in events)
    found["adopted_events"] = sum("adopted" in m for m in events)
    found["lb_event"] = [m for m in events if "recorded on host" in m]
    found["actors_alive_after"] = sorted(named_actors(env_b)) == actors_before
    cli(env_b, "down", "hasvc", "--purge")
    wait("hasvc gone", lambda: not rows("SELECT name FROM services WHERE name='hasvc'"), 60)
    found["actors_left"] = named_actors(env_b)
    engine.dispose()


def named_actors(env: dict[str, str]) -> list[str]:
    """The named actors of the fleetserve namespace that run now."""
    if not ray.is_initialized():
        ray.init(
            address=env["FLEETSERVE_RAY_ADDRESS"], namespace="fleetserve", logging_level="error"
        )
    return sorted(
        str(a["name"] if isinstance(a, dict) else a) for a in ray.util.list_named_actors()
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
