"""bench/controller: what the controller costs as the fleet grows, in one run.

Runs fleetserve's real controller process (REST API, reconcilers, prober, store, load-balancer
manager, one real load balancer per service) over a fake infra whose replicas are listeners of
one process (bench/controller/fakefleet.py, bench_infra.py, fake_controller.py), so 1,000
replicas cost what the controller spends on them, not 1,000 processes. For each scenario
(services x replicas per service), on a fresh controller and home:

  cpu idle       controller CPU (% of one core) with every replica READY, nothing changing
  rss            the controller's resident memory then
  round p50/p99  reconcile round durations in that idle window (every service's rounds)
  db writes/s    INSERT/UPDATE/DELETE statements per second in the idle window (and commits)
  GET /services  p50/p99 of sequential `GET /api/v1/services` (keep-alive, the full body)
  status         wall time of `fleetserve status` (a new CLI process, as a user runs it)
  death -> LB    from killing a READY replica (its listener closes, the infra reports it
                 exited) to the replica's absence from the LB's set (`GET /-/replicas` on the
                 LB's admin API, polled every 10 ms)
  rollout        `fleetserve update` of one service (an env change, a rolling update): the
                 controller's CPU until it ends (or the window ends), its rounds, writes/s

A baseline comes first in the same run: an empty controller (idle CPU, RSS, GET /services,
`fleetserve status`). Then a table of every scenario, and each figure's growth per replica.

Every loop is bounded in count and time; traffic stays on loopback; only processes this run
started are stopped, by pid (the load balancers, which the bench's controller started, are
taken down through the API, then by pid if one is left).

    .venv/bin/python bench/controller/run.py [--quick] [--scenarios 1x10,10x10,100x10,1x1000]
        [--idle-seconds 20] [--launch-delay 0] [--fail-rate 0] [--preempt-rate 0]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
SERVICE_YAML = """\
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 300
  replicas: {replicas}
  max_surge: {surge}
  load_balancer:
    workers: 1
run: echo never runs on the bench infra
envs:
  BENCH_VERSION: "{version}"
"""
FULL_SCENARIOS = "1x10,10x10,100x10,1x1000"
QUICK_SCENARIOS = "1x10"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lb_port_start() -> int:
    """Where the bench's LB ports start: 150 free ports below the ephemeral range (where every
    fake replica and outgoing connection takes its port), above the default 30001+."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    high = max(20000, low - 160)
    return random.randint(max(10000, high - 8000), high)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, by nearest rank; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Window:
    """What the controller did between two moments: CPU, rounds, statements."""

    seconds: float
    cpu_percent: float
    rounds: list[float]
    writes: int
    commits: int
    statements: int
    gc_pauses: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "seconds": round(self.seconds, 2),
            "cpu_percent": round(self.cpu_percent, 2),
            "rounds": len(self.rounds),
            "round_p50_ms": round(pct(self.rounds, 0.5) * 1000, 3),
            "round_p99_ms": round(pct(self.rounds, 0.99) * 1000, 3),
            "writes_per_s": round(self.writes / self.seconds, 2),
            "commits_per_s": round(self.commits / self.seconds, 2),
            "statements_per_s": round(self.statements / self.seconds, 1),
            "gc_per_s": round(len(self.gc_pauses) / self.seconds, 2),
            "gc_max_ms": round(max(self.gc_pauses, default=0.0) * 1000, 2),
        }


@dataclass
class Bench:
    args: argparse.Namespace
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    fleet_port: int = 0
    home: Path = Path()
    api_port: int = 0
    controller: subprocess.Popen[bytes] | None = None
    http: httpx.Client | None = None
    env: dict[str, str] = field(default_factory=dict)
    create_retries: int = 0
    _dumps: int = 0

    # -- processes -------------------------------------------------------------------------

    def start_fleet(self) -> None:
        self.fleet_port = free_port()
        log = open(self.root / "fakefleet.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fakefleet.py"),
                "--port",
                str(self.fleet_port),
                "--preempt-rate",
                str(self.args.preempt_rate),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.fleet_url + "/replicas", timeout=1).status_code == 200:
                    return
            if proc.poll() is not None:
                raise SystemExit(f"fakefleet exited ({proc.returncode}): see {self.root}")
            time.sleep(0.1)
        raise SystemExit("fakefleet did not answer within 20 s")

    @property
    def fleet_url(self) -> str:
        return f"http://127.0.0.1:{self.fleet_port}"

    def start_controller(self, name: str) -> None:
        self.home = self.root / name
        self.home.mkdir(mode=0o700)
        self.api_port = free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("FLEETSERVE_", "BENCH_")) and k != "PYTHONPATH"
        }
        env.update(
            {
                "FLEETSERVE_HOME": str(self.home),
                "FLEETSERVE_API_PORT": str(self.api_port),
                # LB ports away from the default range other fleetserve homes use, and below
                # the kernel's ephemeral range, where fakefleet's replicas listen.
                "FLEETSERVE_LB_PORT_START": str(lb_port_start()),
                "FLEETSERVE_DRAIN_SECONDS": "1",
                "BENCH_FLEET_URL": self.fleet_url,
                "BENCH_LAUNCH_DELAY": str(self.args.launch_delay),
                "BENCH_FAIL_RATE": str(self.args.fail_rate),
                "BENCH_STATS": str(self.home / "bench-stats.json"),
            }
        )
        if self.args.max_launches:
            env["FLEETSERVE_MAX_LAUNCHES"] = str(self.args.max_launches)
        if self.args.src is not None:  # another copy of fleetserve (a before/after pair)
            env["PYTHONPATH"] = str(self.args.src.resolve())
        self.env = env
        (self.home / "logs").mkdir(mode=0o700)
        log = open(self.home / "logs" / "controller.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_controller.py")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        self.controller = proc
        self._dumps = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the controller exited ({proc.returncode}): see {self.home}")
            token = self.home / "api-token"
            with contextlib.suppress(httpx.HTTPError, OSError):
                r = httpx.get(f"http://127.0.0.1:{self.api_port}/api/v1/health", timeout=1)
                if r.status_code == 200 and token.exists():
                    self.http = httpx.Client(
                        base_url=f"http://127.0.0.1:{self.api_port}",
                        headers={"Authorization": f"Bearer {token.read_text().strip()}"},
                        timeout=120,
                        trust_env=False,
                    )
                    return
            time.sleep(0.1)
        raise SystemExit("the controller did not answer within 60 s")

    def stop_controller(self) -> None:
        """`down` every service through the API, then SIGTERM the controller; load balancers
        still alive after that (started by this controller) are stopped by pid."""
        proc = self.controller
        if proc is None:
            return
        http, self.http = self.http, None  # interrupted (SIGTERM) in here: no second try
        if http is not None:
            try:
                with contextlib.suppress(httpx.HTTPError):
                    down_all(http, 180)
            finally:
                http.close()
        lb_pids = self._lb_pids()  # its children: none once every service is down
        stop_pid(proc)
        for pid, created in lb_pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                ours = p.environ().get("FLEETSERVE_HOME") == str(self.home)
                if abs(p.create_time() - created) < 2 and ours:
                    p.kill()
        self.controller = None

    def _lb_pids(self) -> list[tuple[int, float]]:
        """The LB processes of this home (children of the controller: it started them)."""
        out = []
        assert self.controller is not None
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.controller.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    out.append((child.pid, child.create_time()))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_controller()
        for proc in self.procs:
            stop_pid(proc)

    # -- measurements ----------------------------------------------------------------------

    def api(self) -> httpx.Client:
        assert self.http is not None
        return self.http

    def stats(self) -> dict[str, Any]:
        """The controller's own counters (fake_controller.py writes them on SIGUSR1)."""
        assert self.controller is not None
        path = self.home / "bench-stats.json"
        self.controller.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                data: dict[str, Any] = json.loads(path.read_text())
                if data["dumps"] > self._dumps:
                    self._dumps = data["dumps"]
                    return data
            time.sleep(0.02)
        raise SystemExit("the controller wrote no stats within 30 s")

    def cpu_seconds(self) -> float:
        assert self.controller is not None
        t = psutil.Process(self.controller.pid).cpu_times()
        return float(t.user + t.system)

    def rss_mb(self) -> float:
        assert self.controller is not None
        return psutil.Process(self.controller.pid).memory_info().rss / 2**20

    def window(self, seconds: float, until: Any = None) -> Window:
        """Watch the controller for `seconds` (or until `until()` is true, checked each
        second, within `seconds`)."""
        before, cpu0, t0 = self.stats(), self.cpu_seconds(), time.monotonic()
        deadline = t0 + seconds
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if until is not None and until():
                break
        cpu1, t1 = self.cpu_seconds(), time.monotonic()
        after = self.stats()
        rounds = [r[2] for r in after["rounds"] if r[0] > before["at"]]
        pauses = [g[2] for g in after.get("gc", []) if g[0] > before["at"]]
        return Window(
            seconds=t1 - t0,
            cpu_percent=100 * (cpu1 - cpu0) / (t1 - t0),
            rounds=rounds,
            writes=after["writes"] - before["writes"],
            commits=after["commits"] - before["commits"],
            statements=after["statements"] - before["statements"],
            gc_pauses=pauses,
        )

    def profile(self, name: str, seconds: float, load: Any = None) -> None:
        """py-spy's samples of the controller for `seconds` (idle, or while `load()` runs in
        a loop), as collapsed stacks in <--profile>/<name>.txt, with a summary of the
        functions that hold the most samples. Not part of the measured windows."""
        assert self.controller is not None and self.args.profile is not None
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        out = self.args.profile / f"{name}.txt"
        self.args.profile.mkdir(parents=True, exist_ok=True)
        cmd = [spy, "record", "--pid", str(self.controller.pid), "--rate", "200", "--gil"]
        cmd += ["--duration", str(int(seconds)), "--format", "raw", "--output", str(out)]
        spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(spy_proc)
        deadline = time.monotonic() + seconds + 30
        while spy_proc.poll() is None and time.monotonic() < deadline:
            if load is not None:
                load()
            else:
                time.sleep(0.2)
        stop_pid(spy_proc)
        if out.exists():
            (self.args.profile / f"{name}.top.txt").write_text(top_functions(out))

    def list_latency(self, n: int) -> dict[str, float]:
        times = []
        size = 0
        for _ in range(n):
            t0 = time.perf_counter()
            r = self.api().get("/api/v1/services")
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
            size = len(r.content)
        return {
            "p50_ms": round(pct(times, 0.5) * 1000, 2),
            "p99_ms": round(pct(times, 0.99) * 1000, 2),
            "max_ms": round(max(times) * 1000, 2),
            "body_kb": round(size / 1024, 1),
        }

    def cli(self, *args: str, timeout: float = 120) -> tuple[float, str]:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "fleetserve", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"fleetserve {' '.join(args)} failed: {proc.stderr[-2000:]}")
        return took, proc.stdout

    def status_wall(self, n: int) -> float:
        return statistics.median(self.cli("status")[0] for _ in range(n))

    # -- fleets ----------------------------------------------------------------------------

    def create(self, services: int, replicas: int) -> list[str]:
        names = [f"svc-{i:03d}" for i in range(services)]
        surge = max(1, replicas // 10)
        body = {"yaml": SERVICE_YAML.format(replicas=replicas, surge=surge, version=1)}
        for name in names:
            for attempt in range(5):
                r = self.api().post("/api/v1/services", json={**body, "name": name})
                if r.status_code == 201:
                    break
                # A busy controller may not parse a YAML within FLEETSERVE_PARSE_TIMEOUT (a
                # thread starved of the GIL by the event loop): counted, then tried again.
                if "longer than" not in r.text or attempt == 4:
                    raise SystemExit(f"create {name}: HTTP {r.status_code} {r.text[:300]}")
                self.create_retries += 1
                time.sleep(1.0)
        return names

    def ready_count(self) -> tuple[int, int]:
        """(READY replicas, services with a running LB)."""
        body = self.api().get("/api/v1/services").json()
        ready = sum(1 for s in body for r in s["replicas"] if r["status"] == "READY")
        return ready, sum(1 for s in body if s["endpoint"])

    def wait_ready(self, services: int, total: int, seconds: float) -> float:
        t0 = time.monotonic()
        deadline = t0 + seconds
        ready = lbs = 0
        while time.monotonic() < deadline:
            ready, lbs = self.ready_count()
            if ready >= total and lbs >= services:
                return time.monotonic() - t0
            time.sleep(1.0)
        raise SystemExit(
            f"only {ready}/{total} replicas READY and {lbs}/{services} LBs up after {seconds} s"
        )

    def lb_admin(self, service: str) -> tuple[str, dict[str, str]]:
        cfg = json.loads((self.home / "lb" / f"{service}.json").read_text())
        return (
            f"http://127.0.0.1:{cfg['admin_port']}",
            {"Authorization": f"Bearer {cfg['admin_secret']}"},
        )

    def death_to_lb(self, service: str, trials: int, total: int) -> list[float]:
        """Kill READY replicas of `service` one at a time; seconds until each leaves the LB's
        set. Waits for the fleet to be whole again between trials."""
        url, headers = self.lb_admin(service)
        out = []
        with httpx.Client(base_url=url, headers=headers, timeout=5, trust_env=False) as lb:
            for _ in range(trials):
                in_set = {r["replica_id"] for r in lb.get("/-/replicas").json()["replicas"]}
                live = httpx.get(self.fleet_url + "/replicas", timeout=10).json()["replicas"]
                candidates = [
                    r for r in live if r["service"] == service and r["replica_id"] in in_set
                ]
                if not candidates:
                    raise SystemExit(f"no READY replica of {service} in its LB's set")
                victim = random.choice(candidates)
                t0 = time.perf_counter()
                httpx.post(
                    self.fleet_url + "/kill",
                    json={"token": victim["token"], "kind": "EXITED"},
                    timeout=10,
                ).raise_for_status()
                deadline = time.monotonic() + 30
                gone = False
                while time.monotonic() < deadline:
                    ids = {r["replica_id"] for r in lb.get("/-/replicas").json()["replicas"]}
                    if victim["replica_id"] not in ids:
                        gone = True
                        break
                    time.sleep(0.01)
                took = time.perf_counter() - t0
                out.append(took if gone else float("inf"))
                self.wait_ready(1, total, 120)
        return out

    def rollout(self, service: str, replicas: int, seconds: float) -> dict[str, Any]:
        """`fleetserve update` (it follows the rollout to its end, as a user sees it) of one
        service to a new env: the controller's work while it runs, within `seconds`."""
        spec = self.home / "v2.yaml"
        surge = max(1, replicas // 10)
        spec.write_text(SERVICE_YAML.format(replicas=replicas, surge=surge, version=2))
        out = open(self.home / "update.log", "wb")  # noqa: SIM115 - the child holds it
        t0 = time.monotonic()
        cli = subprocess.Popen(
            [sys.executable, "-m", "fleetserve", "update", service, str(spec)],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.procs.append(cli)
        try:
            w = self.window(seconds, until=lambda: cli.poll() is not None)
        finally:
            stop_pid(cli)
        took = time.monotonic() - t0
        s = self.api().get(f"/api/v1/services/{service}").json()
        v2_ready = sum(1 for r in s["replicas"] if r["version"] == 2 and r["status"] == "READY")
        return {
            "completed": cli.returncode == 0 and s["serving_version"] == 2,
            "took_s": round(took, 1),
            "new_ready": v2_ready,
            **w.summary(),
        }


def top_functions(collapsed: Path, n: int = 40) -> str:
    """The functions with the most samples in py-spy's collapsed stacks: inclusive (on the
    stack) and self (at its top), in % of all samples."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + k
        own[frames[-1]] = own.get(frames[-1], 0) + k
    lines = [f"{total} samples", "", "inclusive %:"]
    for f, k in sorted(inclusive.items(), key=lambda x: -x[1])[:n]:
        lines.append(f"  {100 * k / max(total, 1):5.1f}  {f}")
    lines += ["", "self %:"]
    for f, k in sorted(own.items(), key=lambda x: -x[1])[:n]:
        lines.append(f"  {100 * k / max(total, 1):5.1f}  {f}")
    return "\n".join(lines) + "\n"


def down_all(http: httpx.Client, seconds: float) -> None:
    """`fleetserve down` every service (purged), and wait until they are gone (a service
    created meanwhile is taken down too)."""
    deadline = time.monotonic() + seconds
    asked: set[str] = set()
    while time.monotonic() < deadline:
        left = http.get("/api/v1/services").json()
        if not left:
            return
        for svc in left:
            if svc["name"] in asked and svc["status"] == "SHUTTING_DOWN":
                continue
            r = http.request(  # writes take JSON only: an empty object
                "DELETE", f"/api/v1/services/{svc['name']}", params={"purge": "true"}, json={}
            )
            if r.status_code not in (202, 404):
                print(f"down {svc['name']}: HTTP {r.status_code} {r.text[:200]}", flush=True)
            asked.add(svc["name"])
        time.sleep(1.0)


def stop_pid(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process this bench started (by its pid), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def baseline(b: Bench, a: argparse.Namespace) -> dict[str, Any]:
    b.start_controller("empty")
    time.sleep(a.settle)
    w = b.window(a.idle_seconds)
    result = {
        "scenario": "empty",
        "services": 0,
        "replicas": 0,
        "idle": w.summary(),
        "rss_mb": round(b.rss_mb(), 1),
        "list": b.list_latency(a.list_calls),
        "status_s": round(b.status_wall(a.status_runs), 3),
    }
    b.stop_controller()
    return result


def scenario(b: Bench, a: argparse.Namespace, services: int, per: int) -> dict[str, Any]:
    total = services * per
    b.start_controller(f"s{services}x{per}")
    b.create_retries = 0
    t0 = time.monotonic()
    names = b.create(services, per)
    created = time.monotonic() - t0
    up = b.wait_ready(services, total, a.ready_timeout)
    time.sleep(a.settle)
    idle = b.window(a.idle_seconds)
    rss = b.rss_mb()
    listing = b.list_latency(a.list_calls)
    status = b.status_wall(a.status_runs)
    if a.profile is not None:
        b.profile(f"{services}x{per}-idle", a.idle_seconds)
        b.profile(f"{services}x{per}-list", 10, load=lambda: b.api().get("/api/v1/services"))
    deaths = b.death_to_lb(names[0], a.deaths, total)
    roll = b.rollout(names[0], per, a.rollout_seconds)
    result = {
        "scenario": f"{services}x{per}",
        "services": services,
        "replicas": total,
        "create_s": round(created, 2),
        "create_retries": b.create_retries,
        "ready_s": round(up, 1),
        "idle": idle.summary(),
        "rss_mb": round(rss, 1),
        "list": listing,
        "status_s": round(status, 3),
        "death_to_lb_s": [round(d, 3) for d in deaths],
        "rollout": roll,
    }
    b.stop_controller()
    return result


def report(results: list[dict[str, Any]]) -> str:
    rows = [
        ("replicas (services x each)", lambda r: f"{r['replicas']} ({r['scenario']})"),
        ("ready after (s)", lambda r: f"{r.get('ready_s', '-')}"),
        ("cpu idle (% core)", lambda r: f"{r['idle']['cpu_percent']:.1f}"),
        ("rss (MB)", lambda r: f"{r['rss_mb']:.0f}"),
        (
            "round p50 / p99 (ms)",
            lambda r: f"{r['idle']['round_p50_ms']:.1f} / {r['idle']['round_p99_ms']:.1f}",
        ),
        ("rounds/s idle", lambda r: f"{r['idle']['rounds'] / r['idle']['seconds']:.1f}"),
        ("db writes/s idle", lambda r: f"{r['idle']['writes_per_s']:.1f}"),
        ("db statements/s idle", lambda r: f"{r['idle']['statements_per_s']:.0f}"),
        (
            "gc pauses/s, longest (ms)",
            lambda r: f"{r['idle'].get('gc_per_s', 0):.1f}, {r['idle'].get('gc_max_ms', 0):.1f}",
        ),
        (
            "GET /services p50 / p99 (ms)",
            lambda r: f"{r['list']['p50_ms']:.1f} / {r['list']['p99_ms']:.1f}",
        ),
        ("GET /services body (KB)", lambda r: f"{r['list']['body_kb']:.0f}"),
        ("fleetserve status (s)", lambda r: f"{r['status_s']:.2f}"),
        (
            "death -> out of LB (s) p50 / max",
            lambda r: (
                f"{pct(r['death_to_lb_s'], 0.5):.2f} / {max(r['death_to_lb_s']):.2f}"
                if r.get("death_to_lb_s")
                else "-"
            ),
        ),
        (
            "rollout: cpu (% core)",
            lambda r: f"{r['rollout']['cpu_percent']:.1f}" if "rollout" in r else "-",
        ),
        (
            "rollout: done / took (s)",
            lambda r: (
                f"{'yes' if r['rollout']['completed'] else 'no'} / {r['rollout']['took_s']}"
                f" ({r['rollout']['new_ready']} new)"
                if "rollout" in r
                else "-"
            ),
        ),
        (
            "rollout: round p50 / p99 (ms)",
            lambda r: (
                f"{r['rollout']['round_p50_ms']:.1f} / {r['rollout']['round_p99_ms']:.1f}"
                if "rollout" in r
                else "-"
            ),
        ),
        (
            "rollout: db writes/s",
            lambda r: f"{r['rollout']['writes_per_s']:.1f}" if "rollout" in r else "-",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    cols = [[fn(r) for r in results] for _, fn in rows]
    colw = [max(len(c[i]) for c in cols) for i in range(len(results))]
    lines = []
    for (name, _), cells in zip(rows, cols, strict=True):
        lines.append(
            f"{name:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, colw, strict=True))
        )
    base = results[0]
    fleets = [r for r in results if r["replicas"]]
    if base["replicas"] == 0 and fleets:
        lines.append("")
        lines.append("growth over the empty controller, per replica:")
        for r in fleets:
            n = r["replicas"]
            cpu = (r["idle"]["cpu_percent"] - base["idle"]["cpu_percent"]) / n
            rss = (r["rss_mb"] - base["rss_mb"]) * 1024 / n
            get = (r["list"]["p50_ms"] - base["list"]["p50_ms"]) / n
            lines.append(
                f"  {r['scenario']:>8}: cpu {cpu * 1000:+.1f} m%core, rss {rss:+.0f} KB, "
                f"GET /services p50 {get * 1000:+.0f} us"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1x10 only, short windows (~60 s)")
    p.add_argument("--scenarios", default=None, help=f"default {FULL_SCENARIOS}")
    p.add_argument("--idle-seconds", type=float, default=None)
    p.add_argument("--rollout-seconds", type=float, default=None)
    p.add_argument("--settle", type=float, default=None, help="seconds after READY")
    p.add_argument("--deaths", type=int, default=None, help="replica kills per scenario")
    p.add_argument("--list-calls", type=int, default=None)
    p.add_argument("--status-runs", type=int, default=None)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--launch-delay", type=float, default=0.0)
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--preempt-rate", type=float, default=0.0, help="per replica-hour")
    p.add_argument("--max-launches", type=int, default=0, help="FLEETSERVE_MAX_LAUNCHES")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="also profile the controller with py-spy (idle; under GET /services) into DIR",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument(
        "--src",
        type=Path,
        default=None,
        help="run the fleetserve package found in DIR (PYTHONPATH) instead of the installed one",
    )
    a = p.parse_args()
    quick = a.quick
    a.scenarios = a.scenarios or (QUICK_SCENARIOS if quick else FULL_SCENARIOS)
    a.idle_seconds = a.idle_seconds or (4.0 if quick else 20.0)
    a.rollout_seconds = a.rollout_seconds or (20.0 if quick else 60.0)
    a.settle = a.settle if a.settle is not None else (1.0 if quick else 5.0)
    a.deaths = a.deaths or (2 if quick else 5)
    a.list_calls = a.list_calls or (10 if quick else 50)
    a.status_runs = a.status_runs or (1 if quick else 3)
    plan = []
    for item in a.scenarios.split(","):
        s, _, r = item.strip().partition("x")
        plan.append((int(s), int(r)))

    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: every process started is stopped.
    signal.signal(signal.SIGTERM, lambda _s, _f: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="fleetserve-bench-controller-"))
    bench = Bench(a, root)
    results: list[dict[str, Any]] = []
    try:
        bench.start_fleet()
        print(f"bench/controller: {root} ({os.cpu_count()} cores)", flush=True)
        results.append(baseline(bench, a))
        print(json.dumps(results[-1]), flush=True)
        for services, per in plan:
            results.append(scenario(bench, a, services, per))
            print(json.dumps(results[-1]), flush=True)
    finally:
        bench.close()
        if a.json is not None and results:
            a.json.write_text(json.dumps(results, indent=1))
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(report(results))


if __name__ == "__main__":
    main()
