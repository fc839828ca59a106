"""bench/lb: fleetserve's load balancer next to nginx, on loopback, in one run.

Starts 2 fast replicas (bench/lb/replica.py), nginx (1 worker, keep-alive upstream) and
fleetserve's load balancer, then:
  echo    the same bounded wrk load (small POST) against the replicas directly, nginx and
          fleetserve, interleaved over rounds: req/s, p50, p99 and fleetserve/nginx ratios;
  stream  32 concurrent SSE streams of 20 chunks: time to first byte and total time;
  kill    one replica SIGKILLed under load: failed requests, and when the last one failed.

Needs nginx and wrk (Debian: apt-get install nginx-light wrk). Run from the repository root:
    .venv/bin/python bench/lb/run.py [--rounds 3] [--seconds 5] [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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

import aiohttp

HERE = Path(__file__).resolve().parent
POST_LUA = """wrk.method = "POST"
wrk.body = '{"prompt": "hello world", "max_tokens": 16}'
wrk.headers["Content-Type"] = "application/json"
"""
NGINX_CONF = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  upstream replicas {{ {servers} keepalive 128; }}
  server {{
    listen 127.0.0.1:{port} backlog=2048;
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_next_upstream error timeout;
    }}
  }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {seconds} s")


@dataclass
class Procs:
    """Every process this benchmark starts, stopped by pid at the end."""

    workdir: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        cmd: list[str],
        log: str,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> subprocess.Popen[bytes]:
        out = open(self.workdir / log, "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=pass_fds
        )
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.started:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_replica(procs: Procs, rid: int) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, REPLICA_ID=str(rid))
    proc = procs.start(
        [sys.executable, str(HERE / "replica.py"), str(port)], f"replica-{rid}.log", env
    )
    wait_port(port)
    return port, proc


def start_nginx(procs: Procs, name: str, upstreams: list[int]) -> int:
    port = free_port()
    d = procs.workdir / name
    d.mkdir(exist_ok=True)
    servers = " ".join(f"server 127.0.0.1:{p};" for p in upstreams)
    (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, servers=servers, port=port))
    procs.start(["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)], f"{name}.log")
    wait_port(port)
    return port


def start_fleetserve(
    procs: Procs,
    name: str,
    upstreams: list[int],
    data_plane: str = "python",
    policy: str = "least_load",
    options: dict[str, object] | None = None,
) -> tuple[int, int]:
    from fleetserve.lb.config import LbConfig
    from fleetserve.spec.models import LoadBalancerOptions

    port, admin = free_port(), free_port()
    config = LbConfig(
        service="bench",
        port=port,
        admin_port=admin,
        policy=policy,  # type: ignore[arg-type]
        options=LoadBalancerOptions(data_plane=data_plane, **(options or {})),  # type: ignore[arg-type]
    )
    path = procs.workdir / f"{name}.json"
    config.write(path)
    module = "fleetserve.lb.nginx" if data_plane == "nginx" else "fleetserve.lb"
    procs.start([sys.executable, "-m", module, "--config", str(path)], f"{name}.log")
    wait_port(admin)
    body = {
        "replicas": [
            {"replica_id": i + 1, "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(upstreams)
        ]
    }
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{admin}/-/replicas", data=json.dumps(body).encode(), method="PUT"
    )
    urllib.request.urlopen(req, timeout=5).read()
    wait_port(port)
    return port, admin


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _parse(out: str) -> tuple[float, float, float]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if rps is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")

    def pct(p: str) -> float:
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)\b", out)
        if m is None:
            raise RuntimeError(f"wrk printed no {p}th percentile:\n{out}")
        return float(m.group(1)) * _UNITS[m.group(2)]

    return float(rps.group(1)), pct("50"), pct("99")


def _wrk_cmd(url: str, seconds: float, connections: int, lua: Path) -> list[str]:
    return [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{int(seconds)}s",
        "--latency",
        "-s",
        str(lua),
        url,
    ]


def wrk(url: str, seconds: float, connections: int, lua: Path) -> tuple[float, float, float]:
    """(req/s, p50 ms, p99 ms) of one bounded wrk run."""
    out = subprocess.run(
        _wrk_cmd(url, seconds, connections, lua),
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    )
    if "Non-2xx or 3xx responses" in out.stdout:
        print(f"  warning: non-2xx responses from {url}", file=sys.stderr)
    return _parse(out.stdout + out.stderr)


def direct(
    ports: list[int], seconds: float, connections: int, lua: Path
) -> tuple[float, float, float]:
    """Both replicas loaded at once (half the connections each): summed req/s."""
    procs = [
        subprocess.Popen(
            _wrk_cmd(f"http://127.0.0.1:{p}/", seconds, connections // len(ports), lua),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in ports
    ]
    parsed = [_parse(p.communicate(timeout=seconds + 30)[0]) for p in procs]
    return (
        sum(x[0] for x in parsed),
        statistics.mean(x[1] for x in parsed),
        max(x[2] for x in parsed),
    )


async def streams(url: str, n: int = 32) -> tuple[float, float]:
    """n concurrent SSE streams: (p50 time to first byte, p50 total), in ms."""

    async def one(s: aiohttp.ClientSession) -> tuple[float, float]:
        t0 = time.perf_counter()
        async with s.get(url) as r:
            first = None
            chunks = 0
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
                chunks += 1
            assert r.status == 200 and first is not None
        return first * 1e3, (time.perf_counter() - t0) * 1e3

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        results = await asyncio.gather(*(one(s) for _ in range(n)))
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


async def kill_case(
    url: str,
    victim: subprocess.Popen[bytes],
    admin: int | None = None,
    seconds: float = 6,
    kill_at: float = 2,
    concurrency: int = 64,
    limit: int = 200_000,
) -> dict[str, float]:
    """Bounded POST load; SIGKILL `victim` at `kill_at` s: failures and when the last one was."""
    body = b'{"prompt": "hello world", "max_tokens": 16}'
    ok = failed = sent = 0
    last_failure = -1.0
    dead_after_kill = 0
    start = time.perf_counter()
    killed_at: float | None = None
    stop = start + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal ok, failed, sent, last_failure, dead_after_kill
        while time.perf_counter() < stop and sent < limit:
            sent += 1
            try:
                async with s.post(url, data=body) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(r.status)
                    ok += 1
                    if killed_at is not None and r.headers.get("X-Replica") == "1":
                        dead_after_kill += 1
            except (TimeoutError, aiohttp.ClientError, RuntimeError):
                failed += 1
                last_failure = time.perf_counter()

    out_of_rotation: float | None = None

    async def killer() -> None:
        nonlocal killed_at
        await asyncio.sleep(kill_at)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.perf_counter()

    async def watch_rotation(s: aiohttp.ClientSession) -> None:
        # fleetserve only: when the dead replica leaves the routable set
        nonlocal out_of_rotation
        while admin is not None and time.perf_counter() < stop:
            if killed_at is not None:
                async with s.get(f"http://127.0.0.1:{admin}/-/replicas") as r:
                    ids = {u["replica_id"] for u in (await r.json())["replicas"]}
                if 1 not in ids:
                    out_of_rotation = time.perf_counter() - killed_at
                    return
            await asyncio.sleep(0.005)

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=10)
    ) as s:
        await asyncio.gather(killer(), watch_rotation(s), *(worker(s) for _ in range(concurrency)))
    assert killed_at is not None
    return {
        "out_of_rotation_after_s": -1.0 if out_of_rotation is None else out_of_rotation,
        "requests": ok + failed,
        "failed": failed,
        "last_failure_after_kill_s": max(0.0, last_failure - killed_at) if failed else 0.0,
        "answers_from_dead_replica_after_kill": dead_after_kill,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            sys.exit(f"bench/lb needs {tool}: apt-get install nginx-light wrk")
    work = Path(tempfile.mkdtemp(prefix="fleetserve-bench-"))
    procs = Procs(work)
    lua = work / "post.lua"
    lua.write_text(POST_LUA)
    results: dict[str, object] = {}
    try:
        ports = [start_replica(procs, i)[0] for i in (1, 2)]
        nginx = start_nginx(procs, "nginx", ports)
        fleet, _admin = start_fleetserve(procs, "fleetserve", ports)
        native, _ = start_fleetserve(procs, "fleetserve-nginx", ports, data_plane="nginx")
        time.sleep(0.5)  # the nginx plane's first reload
        targets = {
            "direct": None,
            "nginx": f"http://127.0.0.1:{nginx}/",
            "fleetserve": f"http://127.0.0.1:{fleet}/",
            "fs-nginx": f"http://127.0.0.1:{native}/",
        }
        runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in targets}
        for r in range(args.rounds):
            for name, url in targets.items():
                if url is None:
                    runs[name].append(direct(ports, args.seconds, args.connections, lua))
                else:
                    runs[name].append(wrk(url, args.seconds, args.connections, lua))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        echo = {
            name: {
                "rps": statistics.median(x[0] for x in v),
                "p50_ms": statistics.median(x[1] for x in v),
                "p99_ms": statistics.median(x[2] for x in v),
            }
            for name, v in runs.items()
        }
        results["echo"] = echo
        print(
            f"\necho: {args.connections} connections, small POST, 2 replicas, "
            f"median of {args.rounds} interleaved rounds of {args.seconds:g} s"
        )
        print(f"{'target':<12}{'req/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
        for name, e in echo.items():
            print(f"{name:<12}{e['rps']:>12,.0f}{e['p50_ms']:>10.2f}{e['p99_ms']:>10.2f}")
        print(
            "(fs-nginx: fleetserve's optional native data plane, load_balancer.data_plane: nginx)"
        )
        f, n = echo["fleetserve"], echo["nginx"]
        ratios = {
            "throughput_vs_nginx": f["rps"] / n["rps"],
            "p99_vs_nginx": f["p99_ms"] / n["p99_ms"],
        }
        print(
            f"fleetserve/nginx: throughput {ratios['throughput_vs_nginx']:.2f}x "
            f"(target >= 0.5), p99 {ratios['p99_vs_nginx']:.2f}x (target <= 2)"
        )

        stream: dict[str, dict[str, float]] = {}
        for name in ("nginx", "fleetserve"):
            ttfb, total = [], []
            for _ in range(args.rounds):
                a, b = asyncio.run(streams(f"{targets[name]}stream"))
                ttfb.append(a)
                total.append(b)
            stream[name] = {
                "ttfb_p50_ms": statistics.median(ttfb),
                "total_p50_ms": statistics.median(total),
            }
        results["stream"] = stream
        print("\nstream: 32 concurrent SSE streams of 20 chunks, 10 ms apart")
        for name, s in stream.items():
            print(
                f"{name:<12} time to first byte p50 {s['ttfb_p50_ms']:.2f} ms, "
                f"total p50 {s['total_p50_ms']:.1f} ms"
            )
        ratios["stream_ttfb_vs_nginx"] = (
            stream["fleetserve"]["ttfb_p50_ms"] / stream["nginx"]["ttfb_p50_ms"]
        )
        print(
            "fleetserve/nginx time to first byte: "
            f"{ratios['stream_ttfb_vs_nginx']:.2f}x (target <= 1.5)"
        )

        kill: dict[str, dict[str, float]] = {}
        for name in ("nginx", "fleetserve"):
            p1, victim = start_replica(procs, 1)
            p2, _ = start_replica(procs, 2)
            admin = None
            if name == "nginx":
                url = f"http://127.0.0.1:{start_nginx(procs, 'nginx-kill', [p1, p2])}/"
            else:
                port, admin = start_fleetserve(procs, "fleetserve-kill", [p1, p2])
                url = f"http://127.0.0.1:{port}/"
            kill[name] = asyncio.run(kill_case(url, victim, admin))
            if name == "nginx":
                log = (procs.workdir / "nginx-kill" / "error.log").read_text()
                errors = [line for line in log.splitlines() if f"127.0.0.1:{p1}" in line]
                kill[name]["connect_errors_to_dead_replica"] = len(errors)
        results["kill"] = kill
        print("\nkill: 64 concurrent POSTs for 6 s, one replica SIGKILLed at 2 s")
        for name, k in kill.items():
            print(
                f"{name:<12} {int(k['requests']):>7} requests, {int(k['failed'])} failed, "
                f"last failure {k['last_failure_after_kill_s']:.3f} s after the kill, "
                f"{int(k['answers_from_dead_replica_after_kill'])} answers from the dead replica "
                "after it (in flight at the kill)"
            )
            if k["out_of_rotation_after_s"] >= 0:
                print(
                    f"{'':<12} the dead replica left the routable set "
                    f"{k['out_of_rotation_after_s']:.3f} s after the kill"
                )
            if "connect_errors_to_dead_replica" in k:
                print(
                    f"{'':<12} {int(k['connect_errors_to_dead_replica'])} errors talking to the "
                    "dead replica in nginx's log (it tries a failed server again every 10 s)"
                )
        results["ratios"] = ratios
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
