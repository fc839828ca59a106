"""bench/lb/veth.py: what a replica in its own network namespace (a fixed-port fleet on the
local infra, docs/skyserve.md) adds per request, next to one on loopback, in one run.

Starts one bench replica on loopback, one inside a namespace made by fleetserve's own code for
root (fleetserve.infra.netns: a veth pair, a /30 from the replica range) and one in the normal
user's kind (fleetserve.infra.userns: a user namespace reached through a relay), a fleetserve
load balancer in front of each, then sends sequential keep-alive GETs through each LB,
interleaved over rounds: median and mean latency, the ratios to loopback and the added
microseconds. Direct requests (no LB) to each replica are measured too. Needs root and
iproute2 (for the veth pair; the user namespace needs neither):
    sudo .venv/bin/python bench/lb/veth.py [--rounds 5] [--requests 2000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Procs, free_port, wait_port  # noqa: E402


def start_lb(procs: Procs, name: str, upstream: str) -> int:
    from fleetserve.lb.config import LbConfig

    port, admin = free_port(), free_port()
    path = procs.workdir / f"{name}.json"
    LbConfig(service="bench", port=port, admin_port=admin, policy="round_robin").write(path)
    procs.start([sys.executable, "-m", "fleetserve.lb", "--config", str(path)], f"{name}.log")
    wait_port(admin)
    body = json.dumps({"replicas": [{"replica_id": 1, "url": upstream}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/-/replicas", data=body, method="PUT")
    urllib.request.urlopen(req, timeout=5).read()
    wait_port(port)
    return port


def latencies(host: str, port: int, n: int) -> list[float]:
    """Seconds per request: `n` sequential GETs on one keep-alive connection."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("GET", "/")
            resp = conn.getresponse()
            resp.read()
            out.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise RuntimeError(f"{host}:{port} answered {resp.status}")
    finally:
        conn.close()
    return out


def main() -> None:
    from fleetserve.infra.netns import ReplicaNetworks

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (a network namespace)")
    networks = ReplicaNetworks(home_id=f"bench-{uuid.uuid4().hex[:8]}")
    token = uuid.uuid4().hex
    procs = Procs(Path(tempfile.mkdtemp(prefix="fleetserve-veth-")))
    try:
        ns, address = networks.create(token)
        loop_port = free_port()
        env = dict(os.environ, REPLICA_ID="1")
        replica = [sys.executable, str(HERE / "replica.py")]
        procs.start([*replica, str(loop_port)], "loopback.log", env)
        procs.start(["ip", "netns", "exec", ns, *replica, "8080", "0.0.0.0"], "veth.log", env)
        relay = socket.socket()
        relay.bind(("127.0.0.1", 0))
        relay.listen(1024)
        relay_port = int(relay.getsockname()[1])
        procs.start(
            [
                *(sys.executable, "-m", "fleetserve.infra.userns", "--listen-fd"),
                *(str(relay.fileno()), "--port", "8080", "--", *replica, "8080", "0.0.0.0"),
            ],
            "userns.log",
            env,
            pass_fds=(relay.fileno(),),
        )
        relay.close()
        wait_port(loop_port)
        for host, port in ((address, 8080), ("127.0.0.1", relay_port)):
            deadline = time.monotonic() + 10
            while True:
                try:
                    latencies(host, port, 1)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        targets = {
            "direct loopback": ("127.0.0.1", loop_port),
            "direct veth": (address, 8080),
            "LB -> loopback": (
                "127.0.0.1",
                start_lb(procs, "lb-loop", f"http://127.0.0.1:{loop_port}"),
            ),
            "LB -> veth": ("127.0.0.1", start_lb(procs, "lb-veth", f"http://{address}:8080")),
            "direct userns relay": ("127.0.0.1", relay_port),
            "LB -> userns relay": (
                "127.0.0.1",
                start_lb(procs, "lb-userns", f"http://127.0.0.1:{relay_port}"),
            ),
        }
        samples: dict[str, list[float]] = {k: [] for k in targets}
        for host, port in targets.values():
            latencies(host, port, 200)  # warm up
        for _ in range(args.rounds):
            for name, (host, port) in targets.items():
                samples[name] += latencies(host, port, args.requests)
        result = {}
        for name, xs in samples.items():
            result[name] = {
                "p50_us": round(statistics.median(xs) * 1e6, 1),
                "mean_us": round(statistics.fmean(xs) * 1e6, 1),
            }
        lb_loop, lb_veth = result["LB -> loopback"], result["LB -> veth"]
        result["LB veth/loopback p50 ratio"] = round(lb_veth["p50_us"] / lb_loop["p50_us"], 3)
        result["LB added p50_us"] = round(lb_veth["p50_us"] - lb_loop["p50_us"], 1)
        lb_user = result["LB -> userns relay"]
        result["LB userns/loopback p50 ratio"] = round(lb_user["p50_us"] / lb_loop["p50_us"], 3)
        result["LB userns added p50_us"] = round(lb_user["p50_us"] - lb_loop["p50_us"], 1)
        print(json.dumps(result, indent=1))
    finally:
        procs.stop_all()
        networks.remove(token)


if __name__ == "__main__":
    main()
