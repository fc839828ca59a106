"""bench/autoscale/move.py: the LB's `move_waiting_requests` on real vLLM, at a scale-out
whose moment is fixed (not left to an autoscaler), with and without the option, alternated.

Two vLLM replicas of the testbed model (scripts/llm/setup.sh) run from the start, each with
its running batch capped (`--max-num-seqs`, 2) so that a busy replica queues. Each trial:

1. a fresh fleetserve LB (its defaults, `least_load`, `move_waiting_requests` on or off)
   routes to replica 1 only;
2. heavy chat requests (a long prompt of their own, `--tokens` out, streamed) arrive as a
   seeded Poisson process at `--load` times what one replica serves unloaded, for
   `--seconds`; replica 1 queues;
3. at `--add-at` seconds replica 2 joins the LB's set (as the controller's push does when a
   new replica becomes READY): without the option it only gets the requests that arrive
   after; with it, the LB moves requests waiting in replica 1's queue to it;
4. every request is awaited (bounded), the LB is stopped, the replicas' prefix caches are
   emptied.

Trials alternate off, on, on, off, ... (`--trials`) so that a drift in the machine's load
weighs on both alike; each trial gets the same arrivals and prompts (`--seed`). Figures per
trial: TTFT p50/p99/max of every request, of those sent before the scale-out (they queued at
replica 1) and of those after; requests moved (the LB's own counter); failed and empty
answers. This isolates what moving does once a new replica is READY; when it becomes READY
is the autoscaler's part (bench/autoscale/run.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "llm"))

import run as llm  # noqa: E402  (bench/llm/run.py: Procs, start_lb)
from engines import SERVED_NAME, VllmFleet, testbed_model  # noqa: E402


def _autoscale_bench() -> Any:
    """bench/autoscale/run.py (its request and prompt helpers), under a name of its own."""
    spec = importlib.util.spec_from_file_location("bench_autoscale_run", HERE / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _autoscale_bench()
bench.SERVED = SERVED_NAME  # the name VllmFleet serves the model under


def moved_total(admin: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("fleetserve_lb_requests_moved_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return round(total)


def pct(xs: list[float], p: float) -> float:
    return bench.pct(xs, p) if xs else float("nan")


async def calibrate(url: str, args: argparse.Namespace, rng: random.Random) -> float:
    """Seconds one heavy request takes alone on one replica (the mean of 3, after one)."""
    took = []
    async with aiohttp.ClientSession() as session:
        for i in range(4):
            rec = bench.Result("calibrate", 0.0)
            messages = [{"role": "user", "content": bench._text(rng, args.words)}]
            t0 = time.monotonic()
            await bench.one_request(session, url, messages, args.tokens, rec, 120)
            if i and rec.ok:
                took.append(time.monotonic() - t0)
    if not took:
        sys.exit("calibration: no heavy request was answered")
    return sum(took) / len(took)


async def trial(
    lb_url: str, admin: int, ports: list[int], args: argparse.Namespace, rate: float
) -> dict[str, Any]:
    rng = random.Random(args.seed)  # the same arrivals and prompts in every trial
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < args.seconds:
        arrivals.append(t)
        t += rng.expovariate(rate)
    prompts = [bench._text(rng, args.words) for _ in arrivals]
    results = [bench.Result("heavy", at) for at in arrivals]
    llm.push_replicas(admin, ports[:1])
    await asyncio.sleep(1.0)  # (every LB process has the push)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.monotonic()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
            messages = [{"role": "user", "content": prompts[i]}]
            await bench.one_request(
                session, lb_url, messages, args.tokens, results[i], args.request_timeout
            )

        async def scale_out() -> None:
            await asyncio.sleep(max(0.0, start + args.add_at - time.monotonic()))
            await asyncio.to_thread(llm.push_replicas, admin, ports)

        await asyncio.gather(scale_out(), *(one(i) for i in range(len(arrivals))))
    moved = await asyncio.to_thread(moved_total, admin)

    def figures(rs: list[Any]) -> dict[str, float | int]:
        ttfts = [r.ttft * 1000 for r in rs if r.ttft is not None]
        return {
            "requests": len(rs),
            "ttft_p50_ms": pct(ttfts, 50),
            "ttft_p99_ms": pct(ttfts, 99),
            "ttft_max_ms": max(ttfts, default=float("nan")),
            "over_target": sum(1 for x in ttfts if x > args.ttft_target_ms),
        }

    before = [r for r in results if r.sent_at < args.add_at]
    after = [r for r in results if r.sent_at >= args.add_at]
    return {
        "all": figures(results),
        "before": figures(before),
        "after": figures(after),
        "moved": moved,
        "failed": sum(1 for r in results if not r.ok),
        "empty": sum(1 for r in results if r.ok and r.ttft is None),
        "errors": sorted({r.error for r in results if r.error}),
        "requests": [[r.sent_at, r.ttft, r.ok] for r in results],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=4, help="off, on, on, off, ...")
    p.add_argument("--load", type=float, default=2.2, help="x one replica's unloaded rate")
    p.add_argument("--seconds", type=float, default=60, help="how long requests arrive")
    p.add_argument("--add-at", type=float, default=20, help="replica 2 joins at this second")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--words", type=int, default=900, help="a heavy prompt's words")
    p.add_argument("--tokens", type=int, default=96, help="a heavy answer's tokens")
    p.add_argument("--ttft-target-ms", type=float, default=2000)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if args.trials < 1 or not 0 < args.add_at < args.seconds or args.load <= 0:
        p.error("need --trials >= 1, 0 < --add-at < --seconds and --load > 0")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    procs = llm.Procs(Path(tempfile.mkdtemp(prefix="fleetserve-bench-move-")))
    fleet = VllmFleet(
        procs,
        2,
        testbed_model(),
        extra_args=["--enforce-eager", "--max-num-seqs", str(args.max_num_seqs)],
    )
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        log(f"starting 2 vLLM replicas (logs in {procs.workdir}) ...")
        log(f"up in {fleet.start(log):.0f} s")
        unloaded = asyncio.run(calibrate(fleet.urls[0], args, random.Random(args.seed + 1)))
        rate = args.load / unloaded
        out["unloaded_heavy_s"] = unloaded
        log(
            f"one heavy request alone: {unloaded:.2f} s; arrivals {rate:.2f} req/s for "
            f"{args.seconds:g} s; replica 2 joins at {args.add_at:g} s"
        )
        trials = []
        for n in range(args.trials):
            move = n % 4 in (1, 2)  # off, on, on, off, off, on, on, off ...
            lb = llm.start_lb(
                procs, "least_load", {"move_waiting_requests": move}, fleet.ports, f"move-{n}"
            )
            if isinstance(lb, str):
                sys.exit(lb)
            try:
                got = asyncio.run(
                    trial(f"http://127.0.0.1:{lb.port}", lb.admin, fleet.ports, args, rate)
                )
            finally:
                procs.stop(lb.proc)
            got["move"] = move
            trials.append(got)
            a, b, c = got["all"], got["before"], got["after"]
            log(
                f"trial {n + 1} move={'on ' if move else 'off'}: TTFT p50/p99/max "
                f"{a['ttft_p50_ms']:.0f}/{a['ttft_p99_ms']:.0f}/{a['ttft_max_ms']:.0f} ms "
                f"(sent before the scale-out {b['ttft_p50_ms']:.0f}/{b['ttft_p99_ms']:.0f}/"
                f"{b['ttft_max_ms']:.0f}, after {c['ttft_p50_ms']:.0f}/{c['ttft_p99_ms']:.0f}/"
                f"{c['ttft_max_ms']:.0f}); over {args.ttft_target_ms:g} ms "
                f"{a['over_target']}/{a['requests']}; moved {got['moved']}; failed "
                f"{got['failed']}; empty {got['empty']}"
            )
            with contextlib.suppress(Exception):
                asyncio.run(_reset(fleet))
        out["trials"] = trials
    finally:
        fleet.stop()
        procs.stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


async def _reset(fleet: VllmFleet) -> None:
    async with aiohttp.ClientSession() as http:
        await fleet.reset(http)


if __name__ == "__main__":
    main()
