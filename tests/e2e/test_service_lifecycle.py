"""End to end with the real CLI on the local infra: up, serve, crash, restart, down."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sqlite3
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import psutil
import pytest
import trustme

from tests.e2e.conftest import Fleet, endpoint_of, port_in_use

pytestmark = pytest.mark.e2e

TWO_REPLICAS = """\
    name: {name}
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replicas: 2
      load_balancing_policy: round_robin
    workdir: {workdir}
    run: python3 server.py
"""


def get(url: str, timeout: float = 5) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return dict(json.loads(r.read()))


@dataclass
class Load:
    """Bounded background load: at most `limit` requests or `seconds`, whichever comes first."""

    url: str
    limit: int = 20000
    seconds: float = 90
    pause: float = 0.005
    ok: Counter[str] = field(default_factory=Counter)
    versions: list[str] = field(default_factory=list)  # of each answer, in order
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        for _ in range(self.limit):
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            try:
                reply = get(self.url, timeout=5)
                self.ok[reply["replica"]] += 1
                self.versions.append(reply.get("version", "?"))
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                self.failures.append(repr(e))  # a truncated response counts as a failure
            time.sleep(self.pause)

    def __enter__(self) -> Load:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def up(fleet: Fleet, name: str, body: str = TWO_REPLICAS, ready: int = 2) -> str:
    """`fleetserve up` (returns at the first READY replica), then wait for `ready` of them."""
    path = fleet.write_service(name, body.format(name=name, workdir=fleet.workdir))
    out = fleet.cli("up", str(path))

    def all_ready() -> bool:
        with fleet.client() as c:
            return sum(r.status == "READY" for r in c.service(name).replicas) >= ready

    fleet.wait_for(f"{ready} READY replicas", all_ready, timeout=30)
    return endpoint_of(out.stdout)


def test_up_serves_every_replica_and_down_purge_leaves_nothing(fleet: Fleet) -> None:
    endpoint = up(fleet, "hello")
    seen = Counter(get(f"{endpoint}/x")["replica"] for _ in range(20))
    assert set(seen) == {"1", "2"}
    assert fleet.cli("status", "hello", "--endpoint").stdout.strip() == endpoint
    status = fleet.cli("status", "-v").stdout
    assert "READY" in status and "hello" in status and "STARTING -> READY" in status
    assert "starting run on port" in fleet.cli("logs", "--no-follow", "hello", "1").stdout
    assert (
        "load balancer for hello"
        in fleet.cli("logs", "--no-follow", "hello", "--load-balancer").stdout
    )

    with fleet.client() as c:
        pids = [r.pid for r in c.service("hello").replicas]
    lb_port = int(endpoint.rsplit(":", 1)[1])
    fleet.cli("down", "hello", "--purge")
    assert "No services" in fleet.cli("status").stdout
    assert not port_in_use(lb_port)
    left = [p for p in fleet.processes() if p.pid != fleet.controller_pid()]
    assert left == [], [p.cmdline() for p in left]
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    db = sqlite3.connect(fleet.home / "fleetserve.db")
    for table in ("services", "versions", "replicas", "events", "policy_state"):
        assert db.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 0
    assert not (fleet.home / "replicas" / "hello").exists()


def test_killed_replica_is_replaced_while_the_endpoint_keeps_answering(fleet: Fleet) -> None:
    endpoint = up(fleet, "crashy")
    with fleet.client() as c:
        victim = next(r for r in c.service("crashy").replicas if r.replica_id == 1)
    assert victim.pid is not None
    with Load(f"{endpoint}/load") as load:
        time.sleep(0.5)
        os.killpg(victim.pid, signal.SIGKILL)  # kill -9 the replica's whole process group

        def replaced() -> bool:
            with fleet.client() as c:
                reps = {r.replica_id: r for r in c.service("crashy").replicas}
            return reps[1].status == "FAILED" and any(
                r.status == "READY" for rid, r in reps.items() if rid > 2
            )

        fleet.wait_for("a READY replacement", replaced, timeout=30)
        before = sum(load.ok.values())
        time.sleep(1.0)
    assert sum(load.ok.values()) > before  # still answering after the replacement
    total = sum(load.ok.values()) + len(load.failures)
    print(f"\nrequests {total}, failed {len(load.failures)}, per replica {dict(load.ok)}")
    # Connection-refused requests are retried on the other replica; only a request in flight on
    # the killed process at that instant can fail.
    assert len(load.failures) <= 2, load.failures
    assert load.ok["2"] > 0 and load.ok.keys() - {"1", "2"}  # the replacement served traffic
    with fleet.client() as c:
        failed = next(r for r in c.service("crashy").replicas if r.replica_id == 1)
    assert failed.reason is not None and "SIGKILL" in failed.reason


def test_controller_restart_adopts_replicas_and_orphans_nothing(fleet: Fleet) -> None:
    endpoint = up(fleet, "sturdy")
    with fleet.client() as c:
        before = {r.replica_id: r.pid for r in c.service("sturdy").replicas}
    processes_before = {p.pid for p in fleet.processes()}
    controller = fleet.controller_pid()
    os.kill(controller, signal.SIGKILL)
    fleet.wait_for(
        "the controller to die", lambda: controller not in {p.pid for p in fleet.processes()}
    )
    # The load balancer keeps serving its last replica set while the controller is down.
    served = Counter(get(f"{endpoint}/while-down")["replica"] for _ in range(10))
    assert set(served) == {"1", "2"}

    status = fleet.cli("status", "sturdy", "-v").stdout  # starts a new controller on demand
    assert "adopted after controller restart" in status
    with fleet.client() as c:
        after = c.service("sturdy")
    assert {r.replica_id: r.pid for r in after.replicas} == before
    assert all(r.status == "READY" for r in after.replicas)
    time.sleep(2)  # a few reconcile rounds: nothing is relaunched, nothing is left over
    with fleet.client() as c:
        assert [r.replica_id for r in c.service("sturdy").replicas] == [1, 2]
    processes_after = {p.pid for p in fleet.processes()}
    assert processes_after - {fleet.controller_pid()} == processes_before - {controller}


def test_restart_during_a_launch_cleans_up_and_relaunches(fleet: Fleet) -> None:
    body = TWO_REPLICAS.replace("replicas: 2", "replicas: 1").replace(
        "run: python3 server.py", "setup: sleep 300\n    run: python3 server.py"
    )
    path = fleet.write_service("slow", body.format(name="slow", workdir=fleet.workdir))
    fleet.cli("up", str(path), "--detach")

    def setup_running() -> bool:
        return any("sleep" in " ".join(p.cmdline()) for p in fleet.processes())

    fleet.wait_for("setup to start", setup_running, timeout=30)
    sleeper = next(p for p in fleet.processes() if "sleep" in " ".join(p.cmdline()))
    os.kill(fleet.controller_pid(), signal.SIGKILL)
    fleet.cli("server", "start")
    fleet.wait_for("the cut-short setup to be stopped", lambda: not sleeper.is_running(), 30)
    with fleet.client() as c:
        events = [e.message for e in c.events("slow")]
        replica = c.service("slow").replicas[0]
    assert "launch interrupted by a controller restart: relaunching" in events
    assert replica.replica_id == 1 and replica.status in ("PENDING", "PROVISIONING")
    sleepers = [p for p in fleet.processes() if "sleep" in " ".join(p.cmdline())]
    assert len(sleepers) <= 1  # the relaunch's own setup, never the old one as well


def test_a_command_that_always_fails_stops_after_three_tries(fleet: Fleet) -> None:
    body = TWO_REPLICAS.replace("replicas: 2", "replicas: 1").replace(
        "run: python3 server.py", "run: echo boom; exit 4"
    )
    path = fleet.write_service("broken", body.format(name="broken", workdir=fleet.workdir))
    proc = fleet.cli("up", str(path), check=False)
    assert proc.returncode == 1
    assert "FAILED" in proc.stderr and "exited with code 4" in proc.stderr
    # The cause from the replica's own output, and the command that shows the rest.
    assert "last log lines: boom" in proc.stderr
    assert "`fleetserve logs broken 3 --no-follow` shows the rest" in proc.stderr
    with fleet.client() as c:
        svc = c.service("broken")
    assert [r.status for r in svc.replicas] == ["FAILED"] * 3
    assert "boom" in fleet.cli("logs", "--no-follow", "broken", "3").stdout


def test_bad_input_gets_a_clear_error_and_exit_code(fleet: Fleet) -> None:
    bad = fleet.write_service("bad", "service:\n  readiness_probe: health\n  replicas: -1\n")
    proc = fleet.cli("validate", str(bad), check=False)
    assert proc.returncode == 2
    assert "service.readiness_probe.path: must start with '/'" in proc.stderr
    assert "service.replicas:" in proc.stderr
    proc = fleet.cli("up", str(bad), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr

    # A fixed port shared by 2 replicas: namespaces as root (test_fixed_port_fleet.py), else
    # refused with `$PORT` suggested (tests/unit/controller/test_admission.py).
    fixed = fleet.write_service(
        "fixed",
        "service:\n  readiness_probe: /h\n  replicas: 2\nresources:\n  ports: 8080\nrun: x\n",
    )
    assert fleet.cli("validate", str(fixed)).returncode == 0

    proc = fleet.cli("status", "nope", check=False)
    assert proc.returncode == 3 and "does not exist" in proc.stderr
    proc = fleet.cli("down", check=False)
    assert proc.returncode == 2 and "--all" in proc.stderr


def test_bad_api_payloads_get_clear_422s_and_the_controller_carries_on(fleet: Fleet) -> None:
    fleet.cli("server", "start")
    api = f"http://127.0.0.1:{fleet.env['FLEETSERVE_API_PORT']}/api/v1"
    cases: list[tuple[bytes, str]] = [
        (b'{"yaml": 5}', "yaml"),
        (b'{"yaml": "service: ["}', "not valid YAML"),
        (b'{"yaml": "service:\\n  readiness_probe: /h\\n", "bogus": 1}', "bogus"),
        (b"not json at all", "invalid request"),
        (b'{"yaml": "service:\\n  readiness_probe: /h\\n"}', "run: a service needs a `run`"),
    ]
    for body, words in cases:
        req = urllib.request.Request(
            f"{api}/services",
            data=body,
            headers={"Content-Type": "application/json", **fleet.auth()},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 422
        payload = json.loads(e.value.read())
        assert words in payload["error"]["message"], payload
    assert get(f"{api}/health")["ok"]
    docs = urllib.request.Request(
        f"http://127.0.0.1:{fleet.env['FLEETSERVE_API_PORT']}/openapi.json", headers=fleet.auth()
    )
    with urllib.request.urlopen(docs, timeout=5) as r:
        assert "openapi" in json.loads(r.read())


def test_a_dead_load_balancer_is_restarted_on_the_same_port(fleet: Fleet) -> None:
    endpoint = up(fleet, "lbdies")
    lb = next(
        p
        for p in fleet.processes()
        if "fleetserve.lb" in " ".join(p.cmdline()) and "--worker" not in p.cmdline()
    )
    lb.kill()

    def restarted() -> bool:
        with fleet.client() as c:
            events = [e.message for e in c.events("lbdies")]
        return sum(e.startswith("load balancer started") for e in events) >= 2

    # Its other worker serves meanwhile, and the new load balancer beside it, on the same port:
    # not one request fails while the load balancer is replaced.
    deadline = time.monotonic() + 20
    answered = 0
    while not restarted() and time.monotonic() < deadline:
        for _ in range(5):
            assert get(f"{endpoint}/during", timeout=5)["replica"] in ("1", "2")
            answered += 1
    assert restarted() and answered > 0
    time.sleep(6)  # the old worker has gone now; the new load balancer serves alone
    seen = Counter(get(f"{endpoint}/x")["replica"] for _ in range(10))
    assert set(seen) == {"1", "2"}  # the new LB got the whole replica set at once
    with fleet.client() as c:
        events = [e.message for e in c.events("lbdies")]
    assert "load balancer not running: restarting it" in events


SCALE_TO_ZERO = """\
    name: {name}
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replica_policy:
        min_replicas: 0
        max_replicas: 1
        target_qps_per_replica: 1
        qps_window_seconds: 2
        downscale_delay_seconds: 4
    workdir: {workdir}
    run: python3 server.py
"""


def test_scale_to_zero_first_request_succeeds_then_back_to_zero(fleet: Fleet) -> None:
    path = fleet.write_service("lazy", SCALE_TO_ZERO.format(name="lazy", workdir=fleet.workdir))
    out = fleet.cli("up", str(path))
    assert "scaled to zero" in out.stdout
    endpoint = endpoint_of(out.stdout)
    with fleet.client() as c:
        assert c.service("lazy").status == "NO_REPLICA"
    started = time.monotonic()
    reply = get(f"{endpoint}/first", timeout=60)  # held by the LB until a replica is READY
    waited = time.monotonic() - started
    assert reply["replica"] == "1"
    print(f"\nfirst request after idle answered in {waited:.1f} s (cold start)")

    def scaled_to_zero() -> bool:
        with fleet.client() as c:
            svc = c.service("lazy")
        return svc.status == "NO_REPLICA" and not svc.replicas

    fleet.wait_for("the fleet to scale back to zero", scaled_to_zero, timeout=40)
    assert get(f"{endpoint}/again", timeout=60)["replica"] == "2"  # and up again


def test_tls_and_api_keys_from_the_yaml(fleet: Fleet) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(fleet.workdir / "cert.pem"))
    cert.private_key_pem.write_to_path(str(fleet.workdir / "key.pem"))
    key = "sk-" + "a" * 29
    body = TWO_REPLICAS.replace(
        "      load_balancing_policy: round_robin\n",
        "      load_balancing_policy: round_robin\n"
        "      tls: {{keyfile: key.pem, certfile: cert.pem}}\n"
        f"      load_balancer: {{{{api_keys: [{key}]}}}}\n",
    )
    # Relative tls paths start from the folder `up` runs in (as workdir and file_mounts do).
    path = fleet.write_service("secure", body.format(name="secure", workdir=fleet.workdir))
    out = fleet.cli("up", str(path), cwd=fleet.workdir)
    endpoint = endpoint_of(out.stdout)
    assert endpoint.startswith("https://127.0.0.1:")
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    ctx.check_hostname = False  # the certificate names localhost, the endpoint 127.0.0.1
    url = endpoint + "/secret"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, context=ctx, timeout=5)
    assert e.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
        assert json.loads(r.read())["path"] == "/secret"
    lb_log = fleet.cli("logs", "--no-follow", "secure", "--load-balancer").stdout
    assert "TLS" in lb_log and "API keys required" in lb_log
    assert key not in lb_log and key not in fleet.cli("logs", "--no-follow", "--controller").stdout


def test_the_nginx_data_plane_through_the_cli(fleet: Fleet) -> None:
    body = TWO_REPLICAS.replace(
        "      load_balancing_policy: round_robin\n",
        "      load_balancing_policy: round_robin\n      load_balancer: {{data_plane: nginx}}\n",
    )
    endpoint = up(fleet, "native", body)
    time.sleep(0.5)  # nginx reloads with the second replica
    seen = Counter(get(f"{endpoint}/x")["replica"] for _ in range(20))
    assert set(seen) == {"1", "2"}
    driver = next(p for p in fleet.processes() if "fleetserve.lb.nginx" in " ".join(p.cmdline()))
    masters = [c for c in driver.children() if c.name() == "nginx"]
    assert len(masters) == 1
    nginx = masters[0].children() + masters
    fleet.cli("down", "native")
    left = [p for p in fleet.processes() if p.pid != fleet.controller_pid()]
    assert left == [], [p.cmdline() for p in left]
    assert not [p for p in nginx if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
