"""Fixed-port fleets without root: each replica in an unprivileged user + network namespace,
reached through a relay on this machine's loopback (fleetserve.infra.userns).

The whole fleet runs under FLEETSERVE_REPLICA_NETNS=userns (the way a normal user's controller
goes, chosen here by the setting because CI runs as root); the mechanism itself also runs as
the unprivileged user `nobody`, two replicas both on port 8080."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest

from fleetserve.infra import netns, userns
from fleetserve.oshelpers import netcaps
from tests.e2e.conftest import Fleet
from tests.e2e.fixed_port import FIXED, SERVER
from tests.e2e.test_service_lifecycle import get, up

pytestmark = pytest.mark.e2e


def home_netns(fleet: Fleet) -> set[str]:
    """The named network namespaces of this fleet's home (fleetserve.infra.netns's names)."""
    path = fleet.home / "fleetserve.db"
    if not path.exists():
        return set()  # no controller yet: nothing of this home's
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'home_id'").fetchone()
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return {n for n in names if row and netns.token_of_namespace(n, row[0]) is not None}


def _host_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (what slirp4netns reaches)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10)
    for line in out.stdout.splitlines():
        addr = line.split()[3].split("/")[0]
        if not addr.startswith("127."):
            return addr
    return None


def test_a_fixed_port_fleet_in_user_namespaces_serves_heals_and_leaves_nothing(
    fleet: Fleet,
) -> None:
    if not netcaps.userns_available():  # CI's machine allows them; say so loudly where it does not
        pytest.fail("this machine does not allow user namespaces", pytrace=False)
    fleet.env["FLEETSERVE_REPLICA_NETNS"] = "userns"
    (fleet.workdir / "fixed.py").write_text(SERVER)
    netns_before = home_netns(fleet)
    endpoint = up(fleet, "fixed", FIXED, ready=3)
    with fleet.client() as c:
        replicas = c.service("fixed").replicas
    addresses = {r.endpoint for r in replicas}
    # Each replica listens on 8080 in its own namespace; the LB reaches it at a relay port.
    assert len(addresses) == 3, addresses
    assert all(a and a.startswith("http://127.0.0.1:") for a in addresses), addresses
    assert not any(a and a.endswith(":8080") for a in addresses)

    seen = Counter(get(f"{endpoint}/x")["replica"] for _ in range(30))
    assert set(seen) == {"1", "2", "3"} and min(seen.values()) >= 5, seen
    reply = get(f"{endpoint}/x")
    if shutil.which("slirp4netns"):
        assert "tap0" in reply["interfaces"], reply  # the outbound link
        host = _host_address()
        if host is not None:  # a real outbound connection, to a server of this test's
            with socket.create_server((host, 0)) as srv:
                srv.settimeout(10)

                def answer() -> None:
                    with srv.accept()[0] as conn:
                        conn.sendall(b"hello")

                t = threading.Thread(target=answer, daemon=True)
                t.start()
                out = get(f"{endpoint}/out?host={host}&port={srv.getsockname()[1]}")
                t.join(10)
            assert out["out"] == "hello", out
        # The outbound link dies: the replica's log says so, and inbound traffic goes on.
        two = next(r for r in replicas if r.replica_id == 2)
        assert two.pid is not None
        links = [c for c in psutil.Process(two.pid).children() if c.name() == "slirp4netns"]
        assert len(links) == 1, links
        links[0].kill()
        fleet.wait_for(
            "the log line of a dead outbound link",
            lambda: (
                "slirp4netns ended (killed by signal SIGKILL)"
                in fleet.cli("logs", "--no-follow", "fixed", "2").stdout
            ),
            timeout=20,
        )
        assert set(Counter(get(f"{endpoint}/w")["replica"] for _ in range(15))) == {"1", "2", "3"}
    else:
        assert reply["interfaces"] == ["lo"], reply
        assert "loopback only" in fleet.cli("logs", "--no-follow", "fixed", "1").stdout

    victim = next(r for r in replicas if r.replica_id == 1)
    assert victim.pid is not None
    os.killpg(victim.pid, signal.SIGKILL)  # the relay, the replica, its outbound link

    def replaced() -> bool:
        with fleet.client() as c:
            reps = {r.replica_id: r for r in c.service("fixed").replicas}
        return reps[1].status == "FAILED" and sum(r.status == "READY" for r in reps.values()) == 3

    fleet.wait_for("a READY replacement", replaced, timeout=40)
    seen = Counter(get(f"{endpoint}/y")["replica"] for _ in range(30))
    assert len(seen) == 3 and "1" not in seen

    # A restarted controller adopts the replicas: the relays outlive it.
    with fleet.client() as c:
        before = {r.replica_id: r.pid for r in c.service("fixed").replicas if r.status == "READY"}
    controller = fleet.controller_pid()
    os.kill(controller, signal.SIGKILL)
    fleet.wait_for(
        "the controller to die", lambda: controller not in {p.pid for p in fleet.processes()}
    )
    assert "adopted after controller restart" in fleet.cli("status", "fixed", "-v").stdout
    with fleet.client() as c:
        after = {r.replica_id: r.pid for r in c.service("fixed").replicas if r.status == "READY"}
    assert after == before
    assert len(Counter(get(f"{endpoint}/z")["replica"] for _ in range(15))) == 3

    fleet.cli("down", "fixed", "--purge")
    left = [p for p in fleet.processes() if p.pid != fleet.controller_pid()]
    assert left == [], [p.cmdline() for p in left]
    # No named namespaces of this home's: these die with their processes. (Only this home's:
    # tests on other workers, fixed-port fleets as root and the Ray tests' tests/ray/netns.py,
    # make their own meanwhile.)
    assert home_netns(fleet) == netns_before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as `nobody`")
def test_nobody_runs_two_replicas_on_port_8080_without_privilege() -> None:
    """The mechanism as a normal user: `nobody` (no capability at all) starts two replicas that
    both bind 8080, each reached at its own loopback port, one with an outbound link
    (slirp4netns) and one without; nothing is left after a kill."""
    if not netcaps.userns_available():
        pytest.fail("this machine does not allow user namespaces", pytrace=False)
    work = Path(tempfile.mkdtemp(prefix="fs-userns-"))
    try:
        shutil.copy(userns.__file__, work / "userns.py")  # the checkout may be private to root
        (work / "server.py").write_text(SERVER)
        work.chmod(0o755)
        os.chown(work, 65534, 65534)
        script = textwrap.dedent(
            f"""
            import socket, subprocess, sys, time
            procs = []
            # b's PATH has no slirp4netns: a replica with loopback only
            for rid, path in (("a", "/usr/bin:/bin"), ("b", "/nonexistent")):
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                s.listen(64)
                print(s.getsockname()[1], flush=True)
                procs.append(subprocess.Popen(
                    [sys.executable, "{work}/userns.py", "--listen-fd", str(s.fileno()),
                     "--port", "8080", "--", sys.executable, "{work}/server.py"],
                    pass_fds=(s.fileno(),), env={{"FLEETSERVE_REPLICA_ID": rid,
                    "PATH": path}}, start_new_session=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                s.close()
            print(" ".join(str(p.pid) for p in procs), flush=True)
            time.sleep(60)
            """
        )
        driver = subprocess.Popen(
            ["/usr/bin/python3", "-c", script],
            user="nobody",
            cwd=str(work),
            stdout=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        try:
            assert driver.stdout is not None
            ports = [int(driver.stdout.readline()) for _ in range(2)]
            pids = [int(p) for p in driver.stdout.readline().split()]
            seen = {}
            deadline = time.monotonic() + 30
            for port in ports:
                while True:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                            body = r.read().decode()
                        break
                    except OSError:
                        assert time.monotonic() < deadline, f"no answer on {port}"
                        time.sleep(0.2)
                seen[port] = body
            a, b = (json.loads(seen[p]) for p in ports)
            assert a["replica"] == "a" and b["replica"] == "b"
            assert b["interfaces"] == ["lo"]  # no slirp4netns: loopback only
            tun = Path("/dev/net/tun")  # 0666 on most machines, 0600 in some sandboxes
            if shutil.which("slirp4netns", path="/usr/bin:/bin") and os.access(tun, os.F_OK):
                others_rw = tun.stat().st_mode & 0o006 == 0o006
                assert a["interfaces"] == (["lo", "tap0"] if others_rw else ["lo"]), a
            for pid in pids:
                os.killpg(pid, signal.SIGKILL)
        finally:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)
        deadline = time.monotonic() + 10
        while any(_listening(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_listening(p) for p in ports)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if sys.platform != "linux":  # pragma: no cover
    pytest.fail("user namespaces are Linux's", pytrace=False)


def test_two_fixed_port_services_started_at_once_one_broken_in_user_namespaces(
    fleet: Fleet,
) -> None:
    """Both fix port 8080 (namespaced, so both may): the healthy one serves from each of its
    replicas while the broken one's replicas exit; the broken one is reported, not the other."""
    if not netcaps.userns_available():
        pytest.fail("this machine does not allow user namespaces", pytrace=False)
    fleet.env["FLEETSERVE_REPLICA_NETNS"] = "userns"
    (fleet.workdir / "fixed.py").write_text(SERVER)
    fleet.cli("server", "start")
    good = fleet.write_service(
        "good",
        FIXED.replace("replicas: 3", "replicas: 2").format(name="good", workdir=fleet.workdir),
    )
    bad = fleet.write_service(
        "bad",
        FIXED.replace("replicas: 3", "replicas: 2")
        .replace("run: python3 fixed.py", "run: echo boom; exit 3")
        .format(name="bad", workdir=fleet.workdir),
    )
    cmd = [sys.executable, "-m", "fleetserve", "up"]
    procs = [
        subprocess.Popen(
            [*cmd, str(p)], env=fleet.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for p in (good, bad)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0, outs[0]
    assert procs[1].returncode == 1 and "exited with code 3" in outs[1][1], outs[1]

    def good_ready() -> bool:
        with fleet.client() as c:
            return [r.status for r in c.service("good").replicas] == ["READY", "READY"]

    def bad_failed() -> bool:
        # `up` returns at the first failure; the crash-loop stop and the last teardowns follow.
        with fleet.client() as c:
            svc = c.service("bad")
            return bool(svc.failure_reason) and all(r.status == "FAILED" for r in svc.replicas)

    fleet.wait_for("both good replicas READY", good_ready, timeout=30)
    fleet.wait_for("every bad replica FAILED and launches stopped", bad_failed, timeout=30)
    with fleet.client() as c:
        endpoint = c.service("good").endpoint
    assert endpoint is not None
    assert set(Counter(get(f"{endpoint}/x")["replica"] for _ in range(12))) == {"1", "2"}
    fleet.cli("down", "--all", "--purge")
    left = [p for p in fleet.processes() if p.pid != fleet.controller_pid()]
    assert left == [], [p.cmdline() for p in left]
