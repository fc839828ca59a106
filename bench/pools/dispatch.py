"""bench/pools/dispatch.py: what a fleetserve pool adds per job, next to running the same jobs
directly, in one run.

Starts a private controller (its own FLEETSERVE_HOME and ports), applies a pool of W workers,
then runs N jobs of S seconds each through `jobs launch` and waits for all of them. The
baseline, measured in the same run: the same N commands run by a plain pool of W subprocesses
(concurrent.futures), no controller. Prints the makespans, their ratio, the overhead per job
((fleetserve - baseline) / jobs per worker), and the dispatch gap seen in the job records
(from one job's end on a worker to the next one's start there: the controller noticing the
end, choosing a job, starting its process).
    .venv/bin/python bench/pools/dispatch.py [--workers 3] [--jobs 30] [--seconds 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise SystemExit(f"fleetserve {' '.join(args)}: {proc.stderr}")
    return proc.stdout


def baseline(workers: int, jobs: int, seconds: float) -> float:
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        list(
            ex.map(
                lambda _i: subprocess.run(["bash", "-c", f"sleep {seconds}"], check=True),
                range(jobs),
            )
        )
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        env = dict(os.environ)
        env.update(
            FLEETSERVE_HOME=str(home),
            FLEETSERVE_API_PORT=str(free_port()),
            FLEETSERVE_LB_PORT_START=str(free_port()),
            NO_COLOR="1",
        )
        (Path(tmp) / "pool.yaml").write_text(f"pool:\n  workers: {args.workers}\n")
        stamps = Path(tmp) / "stamps.txt"
        (Path(tmp) / "job.yaml").write_text(
            "run: |\n"
            f'  echo "$FLEETSERVE_WORKER_ID start $(date +%s.%N)" >> {stamps}\n'
            f"  sleep {args.seconds}\n"
            f'  echo "$FLEETSERVE_WORKER_ID end $(date +%s.%N)" >> {stamps}\n'
        )
        try:
            cli(env, "pool", "apply", "-p", "bench", str(Path(tmp) / "pool.yaml"))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = cli(env, "pool", "status", "bench")
                if status.count("READY") >= args.workers + 1:  # the pool's row and each worker
                    break
                time.sleep(0.3)
            base = baseline(args.workers, args.jobs, args.seconds)
            started = time.monotonic()
            cli(
                env,
                "jobs",
                "launch",
                "-p",
                "bench",
                "--num-jobs",
                str(args.jobs),
                "--wait",
                str(Path(tmp) / "job.yaml"),
            )
            ours = time.monotonic() - started
            lines = stamps.read_text().split()
        finally:
            subprocess.run(
                [sys.executable, "-m", "fleetserve", "pool", "down", "bench", "--purge"],
                env=env,
                capture_output=True,
                timeout=120,
            )
            subprocess.run(
                [sys.executable, "-m", "fleetserve", "server", "stop"],
                env=env,
                capture_output=True,
                timeout=60,
            )
    # Real process times, written by the jobs: on each worker, from one job's last line to
    # the next one's first (the end noticed, the next job chosen, its process started).
    events: dict[str, list[tuple[float, str]]] = {}
    for worker, kind, at in zip(lines[::3], lines[1::3], lines[2::3], strict=True):
        events.setdefault(worker, []).append((float(at), kind))
    gaps = []
    for seq in events.values():
        seq.sort()
        gaps += [
            b[0] - a[0] for a, b in itertools.pairwise(seq) if a[1] == "end" and b[1] == "start"
        ]
    waves = -(-args.jobs // args.workers)
    print(
        f"pool of {args.workers} workers, {args.jobs} jobs of {args.seconds:g} s "
        f"(ideal makespan {waves * args.seconds:.1f} s)"
    )
    print(f"  baseline (plain subprocess pool): {base:.2f} s")
    print(f"  fleetserve (launch to all done, CLI included): {ours:.2f} s ({ours / base:.3f}x)")
    print(f"  overhead per job: {1000 * (ours - base) / waves:.0f} ms")
    if gaps:
        print(
            f"  dispatch gap on a worker (a job's end -> the next one's start): median "
            f"{1000 * statistics.median(gaps):.1f} ms, max {1000 * max(gaps):.1f} ms over "
            f"{len(gaps)} hand-overs"
        )


if __name__ == "__main__":
    main()
