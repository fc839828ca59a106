"""The Ray scenario (`python -m tests.ray.scenario WORK`), run inside a network namespace of
the test's own (see test_ray_infra.py): a real 3-node Ray cluster, the real controller, CLI and
load balancer. Prints one JSON line of findings; the test asserts on them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

os.environ.update(
    RAY_health_check_period_ms="500",
    RAY_health_check_timeout_ms="500",
    RAY_health_check_failure_threshold="3",
)

import ray
from ray.cluster_utils import Cluster

from tests.ray.netns import SERVER


def main(work: Path) -> None:
    found: dict[str, object] = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    # Zones a and c are spot nodes (they declare `spot`), b is on demand.
    node_a = cluster.add_node(num_cpus=1, resources={"zone:a": 10, "spot": 10})
    node_b = cluster.add_node(num_cpus=1, resources={"zone:b": 10})
    node_c = cluster.add_node(num_cpus=1, resources={"zone:c": 10, "spot": 10})
    cluster.wait_for_nodes()
    env = dict(os.environ)
    env.update(
        FLEETSERVE_HOME=str(work / "home"),
        FLEETSERVE_API_PORT="47999",
        FLEETSERVE_LB_PORT_START="35001",
        FLEETSERVE_RAY_ADDRESS=cluster.address,
        FLEETSERVE_PROBE_INTERVAL="1",
        FLEETSERVE_TERMINATE_GRACE="2",
    )

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "fleetserve", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if out.returncode != 0:
            raise SystemExit(f"fleetserve {args} failed: {out.stdout}\n{out.stderr}")
        return out.stdout

    def api(path: str) -> object:
        token = (work / "home" / "api-token").read_text().strip()
        req = urllib.request.Request(
            f"http://127.0.0.1:47999/api/v1{path}", headers={"Authorization": f"Bearer {token}"}
        )
        return json.loads(urllib.request.urlopen(req, timeout=10).read())

    def service(name: str) -> dict[str, object]:
        return dict(api(f"/services/{name}"))  # type: ignore[call-overload]

    def get(url: str) -> dict[str, object]:
        return dict(json.loads(urllib.request.urlopen(url, timeout=10).read()))

    app = work / "app"
    app.mkdir()
    (app / "server.py").write_text(SERVER)
    (work / "pinned.yaml").write_text(
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: 60}\n  replicas: 1\n"
        f"resources: {{infra: ray, zone: b, cpus: 1}}\nrun: python3 {app}/server.py\n"
    )
    (work / "roaming.yaml").write_text(
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: 60}\n  replicas: 1\n"
        f"resources: {{cpus: 1}}\nrun: python3 {app}/server.py\n"
    )
    # The first `up` of a fresh controller launches two replicas at once: both connect to the
    # cluster concurrently (once raced in ray.init and failed a replica).
    (work / "pair.yaml").write_text(
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: 60}\n  replicas: 2\n"
        f"resources: {{infra: ray, cpus: 0.25}}\nrun: python3 {app}/server.py\n"
    )
    cli("up", str(work / "pair.yaml"), "-n", "pair")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pair = [r["status"] for r in service("pair")["replicas"]]  # type: ignore[index,union-attr]
        if pair == ["READY", "READY"] or "FAILED_PROVISION" in pair:
            break
        time.sleep(0.3)
    found["pair_statuses"] = pair
    cli("down", "pair", "--purge")
    while time.monotonic() < deadline + 60 and any(
        s["name"] == "pair"
        for s in api("/services")  # type: ignore[attr-defined]
    ):
        time.sleep(0.3)
    # A spot service: its replicas go where the spot placer says, zones with spot nodes.
    (work / "spot.yaml").write_text(
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: 60}\n"
        "  replica_policy: {min_replicas: 2, spot_placer: dynamic_fallback}\n"
        f"resources: {{infra: ray, cpus: 0.25, use_spot: true}}\nrun: python3 {app}/server.py\n"
    )
    cli("up", str(work / "spot.yaml"), "-n", "spotray")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spot = service("spotray")
        if sum(r["status"] == "READY" for r in spot["replicas"]) >= 2:  # type: ignore[union-attr]
            break
        time.sleep(0.3)
    spot_names = {node_a.node_id: "a", node_b.node_id: "b", node_c.node_id: "c"}
    found["spot_replicas"] = sorted(
        (str(r["zone"]), bool(r["spot"]), spot_names.get(_node_of(r) or "", "?"))
        for r in spot["replicas"]  # type: ignore[union-attr]
        if r["status"] == "READY"
    )
    found["spot_placer"] = spot["spot_placer"]
    cli("down", "spotray", "--purge")
    # A worker pool on the cluster: jobs run on the workers' nodes, each rank once.
    (work / "pool.yaml").write_text(
        "pool:\n  workers: 2\nresources: {infra: ray, cpus: 0.25}\nsetup: echo ready\n"
    )
    (work / "job.yaml").write_text(
        f'run: echo "rank $SKYPILOT_JOB_RANK on $(hostname) ips $SKYPILOT_NODE_IPS gpus '
        f'$SKYPILOT_NUM_GPUS_PER_NODE" | tee -a {work}/ranks.txt; sleep 1\n'
    )
    # --wait: both workers READY before the jobs go. CI once launched them while the second
    # worker was still starting, and the first ran all six (15 s): the spread was never tested.
    started = time.monotonic()
    cli("pool", "apply", "-p", "raypool", "--wait", str(work / "pool.yaml"))
    found["pool_ready_seconds"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    cli("jobs", "launch", "-p", "raypool", "--num-jobs", "6", "--wait", str(work / "job.yaml"))
    found["pool_jobs_seconds"] = round(time.monotonic() - started, 1)
    jobs = api("/jobs?pool=raypool")
    found["pool_job_statuses"] = sorted({j["status"] for j in jobs})  # type: ignore[attr-defined]
    found["pool_workers_used"] = len({j["worker_id"] for j in jobs})  # type: ignore[attr-defined]
    found["pool_ranks"] = sorted(
        int(line.split()[1]) for line in (work / "ranks.txt").read_text().splitlines()
    )
    first = jobs[0]["job_id"]  # type: ignore[index]
    found["pool_job_log"] = cli("jobs", "logs", str(first))
    cli("pool", "down", "raypool", "--purge")
    started = time.monotonic()
    cli("up", str(work / "pinned.yaml"), "-n", "pinned")
    found["pinned_up_seconds"] = round(time.monotonic() - started, 1)
    pinned = service("pinned")
    rep = pinned["replicas"][0]  # type: ignore[index]
    found["pinned_endpoint"] = pinned["endpoint"]
    found["pinned_answer"] = get(f"{pinned['endpoint']}/")
    found["pinned_replica_host"] = urllib.parse.urlsplit(str(rep["endpoint"])).hostname
    found["pinned_node_is_b"] = _node_of(rep) == node_b.node_id
    found["pinned_log"] = cli("logs", "--no-follow", "pinned", "1")  # streamed from the node
    cli("up", str(work / "roaming.yaml"), "-n", "roaming", "--infra", "ray")
    roaming = service("roaming")
    first = roaming["replicas"][0]  # type: ignore[index]
    node = _node_of(first)
    # The pinned replica holds zone b's only CPU: the roaming one is on node a or c.
    names = {node_a.node_id: "a", node_b.node_id: "b", node_c.node_id: "c"}
    found["roaming_first_node"] = names.get(node or "", "?")
    # Kill that worker node: the replica is LOST (PREEMPTED) and replaced on the other node.
    victim = node_a if node == node_a.node_id else node_c
    killed_at = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    detected = replaced = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        reps = {r["replica_id"]: r for r in service("roaming")["replicas"]}  # type: ignore[index,union-attr]
        if detected is None and reps[first["replica_id"]]["status"] in (
            "PREEMPTED",
            "SHUTTING_DOWN",
        ):
            detected = time.monotonic() - killed_at
        ready = [
            r for rid, r in reps.items() if rid != first["replica_id"] and r["status"] == "READY"
        ]
        if ready:
            replaced = time.monotonic() - killed_at
            found["replacement_node_differs"] = _node_of(ready[0]) != node
            break
        time.sleep(0.3)
    found["lost_detected_after_s"] = None if detected is None else round(detected, 1)
    found["replaced_after_s"] = None if replaced is None else round(replaced, 1)
    found["roaming_answer_after_replacement"] = get(f"{service('roaming')['endpoint']}/")
    # Restart the controller: the running actors are adopted, none relaunched.
    before = {r["replica_id"]: r["pid"] for r in service("pinned")["replicas"]}  # type: ignore[index,union-attr]
    pid = json.loads((work / "home" / "server.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    cli("server", "start")
    time.sleep(3)
    after = service("pinned")
    found["pinned_before_restart"] = before
    found["pinned_after_restart"] = [
        (r["replica_id"], r["pid"], r["status"], r["reason"])
        for r in after["replicas"]  # type: ignore[union-attr]
    ]
    found["adopted_same_replicas"] = {
        r["replica_id"]: r["pid"]
        for r in after["replicas"]  # type: ignore[union-attr]
    } == before and all(r["status"] == "READY" for r in after["replicas"])  # type: ignore[union-attr]
    events = api("/services/pinned/events")
    found["adoption_event"] = any("adopted" in e["message"] for e in events)  # type: ignore[attr-defined]
    cli("down", "--all", "--purge")
    ray.init(address=cluster.address, namespace="fleetserve", logging_level="error")
    found["actors_left"] = ray.util.list_named_actors()
    ray.shutdown()
    cli("server", "stop")
    cluster.shutdown()
    print(json.dumps(found))


def _node_of(replica: object) -> str | None:
    """The Ray node id a replica runs on, as the API shows it."""
    return replica.get("node") if isinstance(replica, dict) else None


if __name__ == "__main__":
    main(Path(sys.argv[1]))
