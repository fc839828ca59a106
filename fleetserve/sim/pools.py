"""A worker pool's autoscaler on a job-arrival trace, on a virtual clock (docs/pools.md).

Jobs arrive (bursts, or Poisson arrivals from a request-rate trace), wait in a FIFO queue and
run `job_seconds` each on a free READY worker; a launched worker is billed from its launch and
takes jobs after `cold_start` seconds. Two autoscalers: fleetserve's (the controller's own
`pool_target`, called once a second) and SkyServe's queue-length autoscaler as documented
(a decision every 20 s; one worker more when the queue stayed above the threshold for the
upscale delay, one fewer when it stayed below for the downscale delay). Measured: the jobs'
mean and p95 wait, the makespan, worker-hours.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fleetserve.policies.jobs import PoolScale, pool_target
from fleetserve.sim.simulator import Trace

POOL_POLICIES = ("fleetserve", "skyserve")
SKYSERVE_TICK = 20.0


@dataclass
class PoolRun:
    policy: str
    jobs: int = 0
    waits: list[float] | None = None
    makespan: float = 0.0
    worker_seconds: float = 0.0
    peak_workers: int = 0

    @property
    def mean_wait(self) -> float:
        return sum(self.waits or [0.0]) / max(1, len(self.waits or []))

    @property
    def p95_wait(self) -> float:
        w = sorted(self.waits or [0.0])
        return w[min(len(w) - 1, math.ceil(0.95 * len(w)) - 1)]

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "mean_wait_s": round(self.mean_wait, 1),
            "p95_wait_s": round(self.p95_wait, 1),
            "makespan_s": round(self.makespan, 1),
            "worker_hours": round(self.worker_seconds / 3600, 3),
            "peak_workers": self.peak_workers,
        }


def burst_arrivals(jobs: int, bursts: int, gap: float) -> list[float]:
    return sorted(b * gap for b in range(bursts) for _ in range(jobs))


def trace_arrivals(trace: Trace, jobs_per_request: float, seed: int = 0) -> list[float]:
    """Poisson arrivals following a request-rate trace (rate x jobs_per_request per second)."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while t < trace.seconds:
        rate = trace.at(t) * jobs_per_request
        n = _poisson(rng, rate * trace.step)
        out += sorted(t + rng.random() * trace.step for _ in range(n))
        t += trace.step
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    if lam > 50:  # the normal approximation: exact sampling would be slow for large rates
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    threshold, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= threshold:
            return k
        k += 1


def simulate_pool(
    arrivals: list[float],
    policy: str,
    job_seconds: float,
    lo: int = 0,
    hi: int = 10,
    threshold: int = 1,
    upscale_delay: float = 60.0,
    downscale_delay: float = 300.0,
    cold_start: float = 60.0,
    tick: float = 1.0,
    max_seconds: float = 30 * 86400.0,
) -> PoolRun:
    if policy not in POOL_POLICIES:
        raise ValueError(f"unknown pool policy {policy!r}: use one of {', '.join(POOL_POLICIES)}")
    run = PoolRun(policy, jobs=len(arrivals), waits=[])
    pending = sorted(arrivals)
    queue: list[float] = []  # arrival times of queued jobs
    workers: list[list[float]] = []  # [ready_at, busy_until]
    state = PoolScale(lo)
    target = lo
    above = below = 0
    t = 0.0
    done = 0
    while done < len(arrivals) and t < max_seconds:
        while pending and pending[0] <= t:
            queue.append(pending.pop(0))
        for w in workers:
            if w[1] <= t and queue and w[0] <= t:
                arrived = queue.pop(0)
                run.waits.append(t - arrived)  # type: ignore[union-attr]
                w[1] = t + job_seconds
                done += 1
                run.makespan = max(run.makespan, w[1])
        running = sum(w[1] > t for w in workers)
        if policy == "fleetserve":
            state = pool_target(
                lo,
                hi,
                threshold,
                upscale_delay,
                downscale_delay,
                state,
                len(queue),
                running,
                1.0,
                t,
            )
            target = state.target
        elif t % SKYSERVE_TICK < tick:
            above = above + 1 if len(queue) > threshold else 0
            below = below + 1 if len(queue) < threshold and running < len(workers) else 0
            if target == 0 and queue:
                target, above = 1, 0
            elif above >= max(1, upscale_delay / SKYSERVE_TICK) and target < hi:
                target, above = target + 1, 0
            elif below >= max(1, downscale_delay / SKYSERVE_TICK) and target > lo:
                target, below = target - 1, 0
        while len(workers) < target:
            workers.append([t + cold_start, t])
        if len(workers) > target:
            idle = [w for w in workers if w[1] <= t]
            idle.sort(key=lambda w: w[0], reverse=True)  # not-ready ones first
            for w in idle[: len(workers) - target]:
                workers.remove(w)
        run.worker_seconds += len(workers) * tick
        run.peak_workers = max(run.peak_workers, len(workers))
        t += tick
    return run


def format_pool_table(runs: list[PoolRun]) -> str:
    lines = [
        f"{'policy':<12}{'jobs':>7}{'mean wait':>11}{'p95 wait':>10}{'makespan':>10}"
        f"{'worker-h':>10}{'peak':>6}"
    ]
    for r in runs:
        lines.append(
            f"{r.policy:<12}{r.jobs:>7}{r.mean_wait:>10.1f}s{r.p95_wait:>9.1f}s"
            f"{r.makespan:>9.0f}s{r.worker_seconds / 3600:>10.2f}{r.peak_workers:>6}"
        )
    return "\n".join(lines)
