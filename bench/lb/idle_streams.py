"""bench/lb/idle_streams.py: what the load balancer's processes cost while long streams run and
nothing else happens (an LLM fleet between requests: answers generating, no new request).

Two replicas stream 30 events 1 s apart (bench/lb/replica.py `GET /slow`); the LB (python data
plane, `--workers` processes) carries `--streams` of them at once; the CPU time of the LB's
processes (the primary and its workers) is measured over `--seconds` while they all run, for
cache_aware (whose processes share one index: fleetserve/lb/index_share.py) and least_load
(nothing shared: the baseline of the same run). Each policy `--repeat` times, in turn.

From the repository root:
    .venv/bin/python bench/lb/idle_streams.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import cpu_seconds
from run import Procs, start_fleetserve, start_replica


async def hold(url: str, streams: int, seconds: float, pid: int) -> float:
    """Open `streams` slow streams, wait until each has its first event, then measure the LB's
    CPU over `seconds`; the LB's share of one core, in percent."""
    timeout = aiohttp.ClientTimeout(total=seconds + 60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = asyncio.Event()
        opened = 0

        async def one() -> None:
            nonlocal opened
            async with http.get(url + "/slow") as r:
                await r.content.readline()
                opened += 1
                if opened == streams:
                    started.set()
                async for _ in r.content:
                    pass

        tasks = [asyncio.create_task(one()) for _ in range(streams)]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(1.0)  # the first events' batches are out
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        cpu1, t1 = cpu_seconds(pid), time.monotonic()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return 100 * (cpu1 - cpu0) / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not (1 <= args.streams <= 256 and 1 <= args.seconds <= 25 and 1 <= args.repeat <= 10):
        ap.error("--streams 1-256, --seconds 1-25 (a stream lasts 30 s), --repeat 1-10")
    results: dict[str, list[float]] = {"least_load": [], "cache_aware": []}
    with tempfile.TemporaryDirectory(prefix="fleetserve-idle-streams-") as tmp:
        procs = Procs(Path(tmp))
        try:
            ports = [start_replica(procs, rid)[0] for rid in (1, 2)]
            for _ in range(args.repeat):
                for policy in results:
                    port, _ = start_fleetserve(
                        procs, policy, ports, policy=policy, options={"workers": args.workers}
                    )
                    lb = procs.started[-1]
                    time.sleep(1.0)  # the workers are up
                    pct = asyncio.run(
                        hold(f"http://127.0.0.1:{port}", args.streams, args.seconds, lb.pid)
                    )
                    results[policy].append(pct)
                    Procs(Path(tmp), [lb]).stop_all()  # this LB only, by its pid
                    procs.started.remove(lb)
                    print(f"{policy}: LB CPU {pct:.2f}% of a core", flush=True)
        finally:
            procs.stop_all()
    base = statistics.median(results["least_load"])
    ca = statistics.median(results["cache_aware"])
    ratio = f"{ca / base:.2f}x least_load's" if base > 0 else "least_load's below the clock tick"
    print(
        f"{args.streams} streams open, {args.workers} LB processes, {args.seconds:g} s each, "
        f"median of {args.repeat}: least_load {base:.2f}% of a core, cache_aware {ca:.2f}% "
        f"({ratio})"
    )


if __name__ == "__main__":
    main()
