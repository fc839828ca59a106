"""SkyServe's common shape, unchanged: `ports: 8080`, a server that binds 8080, 3 replicas.
On the local infra each replica runs in a network namespace of its own (root, iproute2)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import textwrap
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of
from tests.e2e.fixed_port import FIXED, SERVER
from tests.e2e.test_service_lifecycle import get, up

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 or shutil.which("ip") is None:  # never skipped in CI, which runs as root
    pytest.fail("the fixed-port fleet tests need root and iproute2", pytrace=False)


def networks() -> tuple[set[str], set[str]]:
    """fleetserve's namespaces and host-side veths on this machine now."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return (
        {line.split()[0] for line in ns.stdout.splitlines() if line.startswith("fleetserve-")},
        {
            line.split(":")[1].strip().split("@")[0]
            for line in links.stdout.splitlines()
            if line.split(":")[1].strip().startswith("fsh")
        },
    )


def test_fixed_port_replicas_each_in_a_namespace_replaced_and_removed(fleet: Fleet) -> None:
    (fleet.workdir / "fixed.py").write_text(SERVER)
    ns_before, veth_before = networks()
    endpoint = up(fleet, "fixed", FIXED, ready=3)
    with fleet.client() as c:
        replicas = c.service("fixed").replicas
    addresses = {r.endpoint for r in replicas}
    assert len(addresses) == 3, addresses
    assert all(a and a.startswith("http://10.231.") and a.endswith(":8080") for a in addresses)
    assert "10.231." in fleet.cli("status", "fixed", "-v").stdout
    ns_up, veth_up = networks()
    assert len(ns_up - ns_before) == 3 and len(veth_up - veth_before) == 3

    seen = Counter(get(f"{endpoint}/x")["replica"] for _ in range(30))
    # Round robin in each LB worker process: every replica gets a fair share.
    assert set(seen) == {"1", "2", "3"} and min(seen.values()) >= 5, seen
    interfaces = get(f"{endpoint}/x")["interfaces"]
    # Outbound traffic through slirp4netns where installed (CI installs it), else the veth.
    assert ("tap0" in interfaces) == (shutil.which("slirp4netns") is not None), interfaces

    victim = next(r for r in replicas if r.replica_id == 1)
    assert victim.pid is not None
    os.killpg(victim.pid, signal.SIGKILL)

    def replaced() -> bool:
        with fleet.client() as c:
            reps = {r.replica_id: r for r in c.service("fixed").replicas}
        return reps[1].status == "FAILED" and sum(r.status == "READY" for r in reps.values()) == 3

    fleet.wait_for("a READY replacement", replaced, timeout=40)
    deadline = time.monotonic() + 10
    while True:  # the failed replica's namespace goes with it
        ns_now, veth_now = networks()
        if len(ns_now - ns_before) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(ns_now - ns_before) == 3 and len(veth_now - veth_before) == 3
    seen = Counter(get(f"{endpoint}/y")["replica"] for _ in range(30))
    assert len(seen) == 3 and "1" not in seen

    fleet.cli("down", "fixed", "--purge")
    assert networks() == (ns_before, veth_before)
    left = [p for p in fleet.processes() if p.pid != fleet.controller_pid()]
    assert left == [], [p.cmdline() for p in left]


def test_a_restarted_controller_adopts_and_the_sweep_removes_an_orphan_namespace(
    fleet: Fleet,
) -> None:
    (fleet.workdir / "fixed.py").write_text(SERVER)
    ns_before, _ = networks()
    up(fleet, "fixed", FIXED.replace("replicas: 3", "replicas: 2"), ready=2)
    ns_up, _ = networks()
    ours = ns_up - ns_before
    orphan = sorted(ours)[0][: -len("x")] + "x"  # this home's prefix, a token no row knows
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=10)
    try:
        with fleet.client() as c:
            before = {r.replica_id: r.pid for r in c.service("fixed").replicas}
        controller = fleet.controller_pid()
        os.kill(controller, signal.SIGKILL)
        fleet.wait_for(
            "the controller to die", lambda: controller not in {p.pid for p in fleet.processes()}
        )
        status = fleet.cli("status", "fixed", "-v").stdout  # starts a new controller
        assert "adopted after controller restart" in status
        fleet.wait_for("the orphan namespace swept", lambda: orphan not in networks()[0], 30)
        assert networks()[0] - ns_before == ours  # the replicas' namespaces were adopted
        with fleet.client() as c:
            after = c.service("fixed").replicas
        assert {r.replica_id: r.pid for r in after} == before
        assert all(r.status == "READY" for r in after)
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True, timeout=10)
    fleet.cli("down", "fixed", "--purge")
    assert networks()[0] == ns_before


CORPUS = Path(__file__).parent.parent / "fixtures" / "skyserve" / "corpus"

# Our own stand-in for SkyPilot's examples/serve/http_server/server.py (its code is not ours to
# copy): the same contract, port 8080 on every address, 200 on /health and on /.
HTTP_SERVER = textwrap.dedent(
    """
    import http.server, socketserver
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>Hi, SkyPilot here!</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    socketserver.TCPServer.allow_reuse_address = True
    with socketserver.TCPServer(("", 8080), H) as httpd:
        httpd.serve_forever()
    """
)


def test_skyserves_canonical_example_runs_unchanged_from_its_usage_line(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`sky serve up -n http examples/serve/http_server/task.yaml`, from the repository's
    root, with SkyPilot's task.yaml byte for byte: `resources.ports: 8080`, 2 replicas, a
    workdir relative to the current folder."""
    repo = tmp_path / "skypilot"
    example = repo / "examples" / "serve" / "http_server"
    example.mkdir(parents=True)
    shutil.copy(CORPUS / "examples" / "serve" / "http_server" / "task.yaml", example)
    (example / "server.py").write_text(HTTP_SERVER)
    out = fleet.cli("up", "-n", "http", "examples/serve/http_server/task.yaml", cwd=repo)
    endpoint = endpoint_of(out.stdout)
    client = fleet.client()
    fleet.wait_for(
        "both replicas READY",
        lambda: [r.status for r in client.service("http").replicas] == ["READY", "READY"],
        timeout=60,
    )
    for _ in range(6):
        with urllib.request.urlopen(endpoint + "/", timeout=10) as r:
            assert b"SkyPilot here" in r.read()
    assert fleet.cli("status", "--endpoint", "http").stdout.strip() == endpoint
    fleet.cli("down", "http", timeout=120)
