"""Trust, end to end with the real CLI: several services (one broken) on one controller, the
authenticated control plane, another local user, secrets, and databases that are not ours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from fleetserve.home.settings import home_hash
from tests.e2e.conftest import Fleet, endpoint_of, free_port

pytestmark = pytest.mark.e2e

SERVICE = """\
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 20
      replicas: 2
    workdir: {workdir}
    run: python3 {script}
"""

# Serves like the fleet's test server, but its readiness path answers `STATUS`.
BROKEN = textwrap.dedent(
    """
    import json, os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    STATUS = int(os.environ.get("STATUS", "404"))
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            code = STATUS if self.path == "/health" else 200
            body = json.dumps({"replica": os.environ["FLEETSERVE_REPLICA_ID"], "broken": True})
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)


def call(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def answers(url: str) -> bool:
    try:
        return status_of(url) == 200
    except (urllib.error.URLError, OSError):
        return False


def write(fleet: Fleet, name: str, script: str = "server.py", extra: str = "") -> Path:
    body = SERVICE.format(workdir=fleet.workdir, script=script) + textwrap.indent(extra, "    ")
    return fleet.write_service(name, body)


def statuses(fleet: Fleet, name: str) -> list[str]:
    return [r.status for r in fleet.client().service(name).replicas]


def test_services_started_in_parallel_never_share_ports_or_probe_results(fleet: Fleet) -> None:
    """Two healthy services and one whose readiness path answers 404, all started at once:
    every service gets its own endpoint, the healthy ones become READY and stay READY, the
    broken one never becomes READY, and each endpoint serves only its own service."""
    (fleet.workdir / "broken.py").write_text(BROKEN)
    good = write(fleet, "good")
    bad = write(fleet, "bad", "broken.py")
    fleet.cli("server", "start")
    # The shapes users write: a fixed port, a workdir relative to the folder `up` runs in
    # (SkyPilot's meaning), a null env given by --env.
    fixed_port = free_port()
    fixed = fleet.write_service(
        "fixed",
        f"""\
        service:
          readiness_probe: /health
          replicas: 1
          ports: {fixed_port}
        workdir: {fleet.workdir.name}
        envs:
          UNSET: null
        run: python3 server.py
        """,
    )
    jobs = [("up", "-d", str(good), "-n", "a"), ("up", "-d", str(good), "-n", "b")]
    jobs += [("up", "-d", str(bad), "-n", "bad")]
    jobs += [("up", "-d", str(fixed), "-n", "fixed", "--env", "UNSET=given")]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda args: fleet.cli(*args, cwd=fleet.workdir.parent), jobs))
    client = fleet.client()
    fleet.wait_for(
        "every replica of a, b and fixed READY",
        lambda: (
            all(statuses(fleet, n) == ["READY", "READY"] for n in ("a", "b"))
            and statuses(fleet, "fixed") == ["READY"]
        ),
        timeout=60,
    )
    infos = {n: client.service(n) for n in ("a", "b", "bad", "fixed")}
    endpoints = {n: i.endpoint for n, i in infos.items()}
    assert len(set(endpoints.values())) == 4, endpoints
    assert infos["fixed"].replicas[0].endpoint == f"http://127.0.0.1:{fixed_port}"
    # Over several probe rounds (1 s apart here): nothing leaks either way.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert statuses(fleet, "a") == ["READY", "READY"]
        assert statuses(fleet, "b") == ["READY", "READY"]
        assert "READY" not in statuses(fleet, "bad")
        time.sleep(0.5)
    for n in ("a", "b"):
        for _ in range(6):
            status, body = call(str(endpoints[n]) + "/who")
            assert status == 200 and "broken" not in body
    status, _ = call(str(endpoints["bad"]) + "/who")
    assert status == 503  # no ready replica: the broken service's LB serves no one else's
    events = " ".join(e.message for e in client.events("a", limit=200))
    assert "HTTP 404" not in events


def test_the_api_needs_the_token_and_refuses_foreign_hosts_origins_and_forms(
    fleet: Fleet,
) -> None:
    fleet.cli("server", "start")
    api = fleet.api
    home = fleet.home
    assert home.stat().st_mode & 0o777 == 0o700
    assert (home / "api-token").stat().st_mode & 0o777 == 0o600
    assert (home / "fleetserve.db").stat().st_mode & 0o777 == 0o600
    assert call(f"{api}/health")[0] == 200
    for method, path in [
        ("GET", "/services"),
        ("POST", "/services"),
        ("GET", "/services/x/events"),
        ("POST", "/services/x/replicas/1/terminate"),
        ("DELETE", "/services/x"),
        ("GET", "/logs/controller"),
    ]:
        status, body = call(api + path, method, {"Content-Type": "application/json"}, b"{}")
        assert status == 401, (method, path, body)
        status, _ = call(
            api + path,
            method,
            {"Content-Type": "application/json", "Authorization": "Bearer not-the-token"},
            b"{}",
        )
        assert status == 401
    auth = fleet.auth()
    assert call(f"{api}/services", headers=auth)[0] == 200
    # DNS rebinding: the page's own name in the Host header.
    assert call(f"{api}/services", headers={**auth, "Host": "evil.example:80"})[0] == 421
    # A browser page elsewhere (CSRF), even one that got hold of nothing but the port.
    status, _ = call(
        f"{api}/services/x/replicas/1/terminate",
        "POST",
        {**auth, "Origin": "http://evil.example"},
    )
    assert status == 403
    # State-changing calls take JSON only: a form post is refused before it is read.
    status, body = call(
        f"{api}/services",
        "POST",
        {**auth, "Content-Type": "application/x-www-form-urlencoded"},
        b"yaml=x",
    )
    assert status == 415, body
    # The CLI with a wrong token says so and exits 7, touching nothing.
    env = {**fleet.env, "FLEETSERVE_API_TOKEN": "wrong"}
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve", "status"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 7 and "refused the API token" in proc.stderr


def test_the_load_balancer_admin_api_needs_its_secret(fleet: Fleet) -> None:
    out = fleet.cli("up", str(write(fleet, "svc")), "-n", "svc")
    endpoint = endpoint_of(out.stdout)
    db = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import json,sqlite3,sys; c=sqlite3.connect(sys.argv[1]); "
                "print(json.dumps(c.execute('select lb_admin_port, lb_secret from services')"
                ".fetchone()))",
                str(fleet.home / "fleetserve.db"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    admin_port, secret = db
    admin = f"http://127.0.0.1:{admin_port}"
    assert call(f"{admin}/-/health")[0] == 200
    hijack = json.dumps({"replicas": [{"replica_id": 9, "url": "http://127.0.0.1:9"}]}).encode()
    assert call(f"{admin}/-/replicas", "PUT", {}, hijack)[0] == 401
    assert call(f"{admin}/-/replicas", "PUT", {"Authorization": "Bearer nope"}, hijack)[0] == 401
    assert call(f"{admin}/-/load")[0] == 401
    assert call(f"{admin}/metrics")[0] == 401
    status, body = call(f"{admin}/-/replicas", headers={"Authorization": f"Bearer {secret}"})
    routed = [r["replica_id"] for r in body["replicas"]]  # type: ignore[attr-defined]
    assert status == 200 and routed and 9 not in routed
    assert call(endpoint + "/still")[0] == 200  # the refused push changed nothing
    lb_log = fleet.cli("logs", "--no-follow", "svc", "--load-balancer").stdout
    assert secret not in lb_log


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as `nobody`")
def test_another_local_user_gets_401s_and_reads_no_file(tmp_path: Path, fleet: Fleet) -> None:
    """The home lives in a folder every user may enter: only its 0700 mode and the token keep
    `nobody` out."""
    open_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetserve-open-{os.getpid()}"
    open_dir.mkdir(mode=0o755, exist_ok=True)
    open_dir.chmod(0o755)
    home = open_dir / "home"
    fleet.env["FLEETSERVE_HOME"] = str(home)
    fleet.home = home
    secret = "s3cr3t-" + os.urandom(6).hex()
    path = write(fleet, "svc", extra=f"secrets:\n  HF_TOKEN: {secret}\n")
    try:
        out = fleet.cli("up", str(path), "-n", "svc")
        endpoint = endpoint_of(out.stdout)
        admin_port = json.loads((home / "lb" / "svc.json").read_text())["admin_port"]
        probe = textwrap.dedent(
            f"""
            import json, os, urllib.request, urllib.error
            out = {{}}
            for url, method in [
                ("{fleet.api}/services", "GET"),
                ("{fleet.api}/services", "POST"),
                ("{fleet.api}/services/svc/replicas/1/terminate", "POST"),
                ("http://127.0.0.1:{admin_port}/-/replicas", "PUT"),
                ("http://127.0.0.1:{admin_port}/-/load", "GET"),
            ]:
                req = urllib.request.Request(url, method=method, data=b"{{}}" if method != "GET"
                    else None, headers={{"Content-Type": "application/json"}})
                try:
                    out[method + " " + url] = urllib.request.urlopen(req, timeout=5).status
                except urllib.error.HTTPError as e:
                    out[method + " " + url] = e.code
            readable = []
            for root, dirs, files in os.walk("{home}"):
                for f in files:
                    try:
                        open(os.path.join(root, f), "rb").read(1)
                        readable.append(os.path.join(root, f))
                    except OSError:
                        pass
            for f in ["api-token", "fleetserve.db", "logs/controller.log", "lb/svc.json"]:
                try:
                    open(os.path.join("{home}", f), "rb").read(1)
                    readable.append(f)
                except OSError:
                    pass
            print(json.dumps({{"codes": out, "readable": readable}}))
            """
        )
        proc = subprocess.run(
            ["/usr/bin/python3", "-c", probe],
            user="nobody",
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert set(seen["codes"].values()) == {401}, seen["codes"]
        assert seen["readable"] == []
        assert call(endpoint + "/x")[0] == 200  # the service itself is public, as meant
        # The secret reaches the replica, and no output of ours.
        shown = [
            fleet.cli("status", "-v").stdout,
            fleet.cli("status", "svc", "-v").stdout,
            fleet.cli("logs", "--no-follow", "--controller").stdout,
            fleet.cli("logs", "--no-follow", "svc", "--load-balancer").stdout,
            json.dumps(call(f"{fleet.api}/services", headers=fleet.auth())[1]),
            json.dumps(call(f"{fleet.api}/services/svc/events", headers=fleet.auth())[1]),
        ]
        for text in shown:
            assert secret not in text
        for replica in fleet.client().service("svc").replicas:
            assert replica.pid is not None
            assert psutil.Process(replica.pid).environ().get("HF_TOKEN") == secret
    finally:
        fleet.cli("down", "--all", "--purge", check=False)
        fleet.cli("server", "stop", check=False)
        shutil.rmtree(open_dir, ignore_errors=True)


def _stop_controller(fleet: Fleet) -> None:
    fleet.cli("server", "stop")
    fleet.wait_for("controller gone", lambda: not (fleet.home / "server.json").exists(), 30)


def test_an_empty_database_stops_nothing_and_says_how_to_fix_it(fleet: Fleet) -> None:
    out = fleet.cli("up", str(write(fleet, "svc")), "-n", "svc")
    endpoint = endpoint_of(out.stdout)
    before = {p.pid for p in fleet.processes()}
    controller = fleet.controller_pid()
    _stop_controller(fleet)
    db = fleet.home / "fleetserve.db"
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    saved = db.read_bytes()
    db.write_bytes(b"")
    proc = fleet.cli("server", "start", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(db) in lines[0] and "empty" in lines[0], proc.stderr
    assert call(endpoint + "/alive")[0] == 200
    assert {p.pid for p in fleet.processes()} == before - {controller}
    db.write_bytes(saved)  # restored: the fleet is adopted as it was
    fleet.cli("server", "start")
    fleet.wait_for("READY", lambda: fleet.client().service("svc").status == "READY", 30)
    assert call(endpoint + "/alive")[0] == 200


def test_a_copied_database_in_a_second_home_adopts_and_stops_nothing(
    tmp_path: Path, fleet: Fleet
) -> None:
    out = fleet.cli("up", str(write(fleet, "svc")), "-n", "svc")
    endpoint = endpoint_of(out.stdout)
    pids = {r.pid for r in fleet.client().service("svc").replicas}
    second = tmp_path / "second"
    second.mkdir(mode=0o700)
    fleet.client().status()  # the first controller keeps running meanwhile
    for name in ("fleetserve.db", "fleetserve.db-wal", "fleetserve.db-shm"):
        if (fleet.home / name).exists():
            shutil.copy(fleet.home / name, second / name)
    env = {**fleet.env, "FLEETSERVE_HOME": str(second), "FLEETSERVE_API_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve", "down", "svc"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"belongs to the fleetserve home {fleet.home}" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    for pid in pids:
        assert pid is not None and psutil.pid_exists(pid)
    assert call(endpoint + "/alive")[0] == 200
    assert not (second / "server.json").exists()


def test_a_failed_controller_start_keeps_the_running_ones_log(tmp_path: Path, fleet: Fleet) -> None:
    fleet.cli("server", "start")
    log = fleet.home / "logs" / "controller.log"
    before = log.read_text()
    assert "controller starting" in before
    # The same home: refused by its lock. Another home on the same port: refused at bind.
    again = fleet.cli("server", "start", check=False)
    assert again.returncode == 0 and "already running" in again.stdout
    other = {**fleet.env, "FLEETSERVE_HOME": str(tmp_path / "other")}
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve.api.server"],
        env=other,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0 and "cannot listen on" in proc.stderr
    assert log.read_text().startswith(before)
    assert fleet.client().status() == []


def test_a_public_address_needs_tls_and_a_remote_cli_works_over_it(
    tmp_path: Path, fleet: Fleet
) -> None:
    import trustme

    refused = fleet.cli("server", "start", "--host", "0.0.0.0", check=False)
    assert refused.returncode == 2 and "needs TLS" in refused.stderr
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.2", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    fleet.cli(
        "server",
        "start",
        "--host",
        "0.0.0.0",
        "--tls-cert",
        str(tmp_path / "cert.pem"),
        "--tls-key",
        str(tmp_path / "key.pem"),
        "--allowed-host",
        "127.0.0.2",
    )
    token = (fleet.home / "api-token").read_text().strip()
    # A client that shares nothing with the controller's home: URL, token and CA only.
    remote = {
        **fleet.env,
        "FLEETSERVE_HOME": str(tmp_path / "laptop"),
        "FLEETSERVE_API_URL": f"https://127.0.0.2:{fleet.env['FLEETSERVE_API_PORT']}",
        "FLEETSERVE_API_CA": str(tmp_path / "ca.pem"),
    }

    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleetserve", *args],
            env={**remote, **env},
            capture_output=True,
            text=True,
            timeout=90,
        )

    no_token = cli("status")
    assert no_token.returncode == 7, no_token.stderr
    wrong = cli("status", FLEETSERVE_API_TOKEN="x" * 43)
    assert wrong.returncode == 7 and "FLEETSERVE_API_TOKEN" in wrong.stderr
    untrusted = cli("status", FLEETSERVE_API_TOKEN=token, FLEETSERVE_API_CA="")
    assert untrusted.returncode != 0 and "FLEETSERVE_API_CA" in untrusted.stderr
    path = write(fleet, "remote")
    up = cli("up", str(path), "-n", "remote", FLEETSERVE_API_TOKEN=token)
    assert up.returncode == 0, up.stderr
    assert "READY" in cli("status", "remote", FLEETSERVE_API_TOKEN=token).stdout
    assert not (tmp_path / "laptop").exists()  # the remote client started nothing locally
    down = cli("down", "remote", FLEETSERVE_API_TOKEN=token)
    assert down.returncode == 0, down.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as `nobody`")
def test_the_token_never_goes_to_a_port_another_user_holds(fleet: Fleet) -> None:
    """With the controller down, another user listens on its port and mimics /health (the
    home's hash included): the CLI refuses to send it the token."""
    fleet.cli("server", "start")  # makes the token
    _stop_controller(fleet)
    port = fleet.env["FLEETSERVE_API_PORT"]
    # The strongest thief: one whose /health answer is this home's own (it would need the
    # token to make it; here the test gives it one).
    perfect = home_hash(fleet.home, (fleet.home / "api-token").read_text().strip())
    fake = textwrap.dedent(
        f"""
        import json, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                print("AUTH", self.headers.get("Authorization"), flush=True)
                body = json.dumps({{"ok": True, "version": "x",
                                    "home_hash": "{perfect}"}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a):
                pass
        HTTPServer(("127.0.0.1", {port}), H).serve_forever()
        """
    )
    thief = subprocess.Popen(
        ["/usr/bin/python3", "-c", fake],
        user="nobody",
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        fleet.wait_for("the thief's port", lambda: answers(f"{fleet.api}/health"), 10)
        proc = fleet.cli("status", check=False)
        assert proc.returncode == 7 and "not held by this user's controller" in proc.stderr, (
            proc.stderr
        )
    finally:
        thief.kill()
        out, _ = thief.communicate(timeout=10)
    token = (fleet.home / "api-token").read_text().strip()
    assert token not in out
    assert "AUTH None" in out  # it was asked for /health only, without the token


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as `nobody`")
def test_a_home_another_user_planted_first_is_refused(fleet: Fleet) -> None:
    """In a folder every user may write, `nobody` creates the owner's FLEETSERVE_HOME first,
    with a token it knows and a symlink for the controller's log: the owner's start refuses
    with one line, follows no symlink and adopts no token."""
    shared = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetserve-shared-{os.getpid()}"
    shared.mkdir(exist_ok=True)
    shared.chmod(0o1777)
    victim = shared / "victim"
    victim.write_text("owner's file\n")
    victim.chmod(0o644)
    home = shared / "home"
    plant = textwrap.dedent(
        f"""
        import os
        os.umask(0)
        os.mkdir("{home}", 0o777)
        open("{home}/api-token", "w").write("ATTACKER-KNOWN-TOKEN-0000000000000000000000\\n")
        os.mkdir("{home}/logs", 0o777)
        os.symlink("{victim}", "{home}/logs/controller.log")
        """
    )
    try:
        subprocess.run(
            ["/usr/bin/python3", "-c", plant], user="nobody", check=True, cwd="/", timeout=30
        )
        fleet.env["FLEETSERVE_HOME"] = str(home)
        fleet.home = home
        proc = fleet.cli("server", "start", check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "belongs to uid 65534" in lines[0], proc.stderr
        assert victim.read_text() == "owner's file\n" and victim.stat().st_mode & 0o777 == 0o644
        assert not (home / "server.json").exists() and fleet.processes() == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as `nobody`")
def test_a_replica_port_another_user_took_first_never_becomes_ready(fleet: Fleet) -> None:
    """The replica's server binds late (as a model server does after loading its weights);
    `nobody` binds the fixed port first and answers the probe: no READY, no traffic."""
    port = free_port()
    squat = textwrap.dedent(
        f"""
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.send_header("Content-Length", "6")
                self.end_headers(); self.wfile.write(b"stolen")
            do_POST = do_GET
            def log_message(self, *a): pass
        HTTPServer(("127.0.0.1", {port}), H).serve_forever()
        """
    )
    spec = fleet.write_service(
        "late",
        f"""\
        service:
          readiness_probe: {{path: /health, initial_delay_seconds: 60}}
          replicas: 1
          ports: {port}
        workdir: {fleet.workdir}
        run: sleep 3600
        """,
    )
    fleet.cli("up", "-d", str(spec), "-n", "late")
    fleet.wait_for(
        "STARTING", lambda: statuses(fleet, "late") == ["STARTING"], timeout=30
    )  # launched: the port was free; the replica has not bound it yet
    thief = subprocess.Popen(["/usr/bin/python3", "-c", squat], user="nobody", cwd="/")
    try:
        fleet.wait_for("the squatter", lambda: answers(f"http://127.0.0.1:{port}/"), 10)
        time.sleep(6)  # several probes (every second while STARTING)
        svc = fleet.client().service("late")
        assert "READY" not in [r.status for r in svc.replicas]
        assert statuses(fleet, "late") == ["STARTING"]
        assert status_of(str(svc.endpoint) + "/x") == 503  # no traffic reaches the squatter
    finally:
        thief.kill()
        thief.wait()
