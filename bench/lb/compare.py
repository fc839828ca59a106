"""bench/lb/compare.py: bench/lb/policies.py's load against two (or more) checkouts of fleetserve
side by side, in one run: a change's cost on the request path, measured where the machine's
other load hits both sides alike.

Starts 2 fast replicas and, per (checkout, policy), one load balancer (default workers) whose
processes import fleetserve from that checkout (PYTHONPATH); then rounds of the same bounded
wrk load against each, the order reversed every other round. Prints per checkout and policy
the median req/s, p50 and p99, and the CPU time the LB's processes spent per request, with
ranges, then each policy's per-round ratios of the last checkout to the first.

Needs wrk. From the repository root, e.g. with the base commit exported to /tmp/base:
    git archive BASE | tar -x -C /tmp/base
    .venv/bin/python bench/lb/compare.py --tree before=/tmp/base --tree after=. \\
        --policies round_robin,least_load,cache_aware --rounds 5 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policies import chat_lua
from run import Procs, free_port, start_replica, wait_port, wrk

from fleetserve.lb.config import LbConfig

# A load balancer's start (importing fleetserve, its workers) may take long on a loaded
# machine: the side-by-side runs several at once.
LB_START_SECONDS = 60

Figures = tuple[float, float, float, float]  # req/s, p50 ms, p99 ms, LB CPU us per request


def start_lb(procs: Procs, name: str, tree: Path, policy: str, ports: list[int]) -> tuple[str, int]:
    port, admin = free_port(), free_port()
    config = LbConfig(service="bench", port=port, admin_port=admin, policy=policy)  # type: ignore[arg-type]
    path = procs.workdir / f"{name}.json"
    config.write(path)
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, "-m", "fleetserve.lb", "--config", str(path)]
    proc = procs.start(cmd, f"{name}.log", env=env)
    wait_port(admin, LB_START_SECONDS)
    body = {
        "replicas": [
            {"replica_id": i + 1, "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(ports)
        ]
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{admin}/-/replicas", data=json.dumps(body).encode(), method="PUT"
    )
    urllib.request.urlopen(req, timeout=5).read()
    wait_port(port, LB_START_SECONDS)
    return f"http://127.0.0.1:{port}/", proc.pid


def minmax(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def cpu_seconds(pid: int) -> float:
    """User + system time of the LB's primary and its workers."""
    total = 0.0
    primary = psutil.Process(pid)
    for p in [primary, *primary.children()]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--policies", default="round_robin,least_load,cache_aware")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write every round's figures here")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/lb/compare.py needs wrk: apt-get install wrk")
    trees = {name: Path(path) for name, _, path in (t.partition("=") for t in args.tree)}
    policies = args.policies.split(",")
    work = Path(tempfile.mkdtemp(prefix="fleetserve-bench-compare-"))
    procs = Procs(work)
    lua = work / "chat.lua"
    lua.write_text(chat_lua())
    runs: dict[tuple[str, str], list[Figures]] = {}
    try:
        ports = [start_replica(procs, i)[0] for i in (1, 2)]
        targets = {
            (tree, policy): start_lb(procs, f"{tree}-{policy}", path, policy, ports)
            for tree, path in trees.items()
            for policy in policies
        }
        time.sleep(2)  # every worker up
        runs = {k: [] for k in targets}
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for k in order:
                url, pid = targets[k]
                before = cpu_seconds(pid)
                rps, p50, p99 = wrk(url, args.seconds, args.connections, lua)
                used = cpu_seconds(pid) - before
                runs[k].append((rps, p50, p99, used / max(1.0, rps * args.seconds) * 1e6))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        procs.stop_all()

    def span(values: list[float], fmt: str) -> str:
        mid, low, high = (fmt.format(x) for x in (statistics.median(values), *minmax(values)))
        return f"{mid} ({low}-{high})"

    print(
        f"\nchat bodies (2-5 KiB), {args.connections} connections, 2 replicas, LB workers: "
        f"default; medians (ranges) of {args.rounds} interleaved rounds of {args.seconds} s"
    )
    for (tree, policy), v in sorted(runs.items(), key=lambda kv: kv[0][1]):
        p50 = statistics.median(x[1] for x in v)
        p99 = statistics.median(x[2] for x in v)
        print(
            f"{policy:<16}{tree:<10} req/s {span([x[0] for x in v], '{:,.0f}'):<24}"
            f" p50 {p50:.2f} ms  p99 {p99:.2f} ms"
            f"  LB CPU/request {span([x[3] for x in v], '{:.0f}')} us"
        )
    names = list(trees)
    first, last = names[0], names[-1]
    for policy in policies:
        pairs = list(zip(runs[(last, policy)], runs[(first, policy)], strict=True))
        rps = [a[0] / b[0] for a, b in pairs]
        cpu = [a[3] / b[3] for a, b in pairs]
        print(
            f"{policy}: {last}/{first} req/s per round "
            + ", ".join(f"{x:.2f}" for x in rps)
            + f" (median {statistics.median(rps):.2f}); CPU per request "
            + ", ".join(f"{x:.2f}" for x in cpu)
            + f" (median {statistics.median(cpu):.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps({f"{t}/{p}": v for (t, p), v in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
