"""Worker pools as pure decisions: which queued job starts on which worker, what happens to a
job whose worker is gone, and how many workers the queue wants (docs/pools.md).

No I/O; the pool's reconciler observes the workers and jobs, calls these and applies the
actions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetserve.core.types import JobRecord, JobStatus, ReplicaId

DEFAULT_MAX_ATTEMPTS = 3  # starts of one job before a lost worker fails it
DEFAULT_UPSCALE_DELAY = 5.0  # seconds the queue must stay long before workers are added
DEFAULT_DOWNSCALE_DELAY = 60.0  # seconds with idle workers and no queue before they go
# Jobs running at once on one worker, whatever their share of it: `cpus: 0.001` on a 4-CPU
# worker would otherwise pack 4,000 processes (and their wrappers) onto it.
MAX_JOBS_PER_WORKER = 64


@dataclass(frozen=True)
class WorkerView:
    replica_id: ReplicaId
    ready: bool  # setup done, alive: takes jobs
    alive: bool  # its jobs may still be running (READY, or not yet noticed as gone)
    capacity: float = 1.0  # slots: how many one-slot jobs fit at once


@dataclass(frozen=True)
class JobExit:
    """A running job's process ended (its exit code; negative: the signal), or vanished with
    no exit code (`lost`: its wrapper was killed too)."""

    exit_code: int
    lost: bool = False


@dataclass(frozen=True)
class StartJob:
    job_id: int
    worker_id: ReplicaId  # the worker is a replica of the pool


@dataclass(frozen=True)
class FinishJob:
    job_id: int
    status: JobStatus
    exit_code: int | None
    reason: str


@dataclass(frozen=True)
class RequeueJob:
    job_id: int
    reason: str


JobAction = StartJob | FinishJob | RequeueJob


def _lost(job: JobRecord, why: str, max_attempts: int) -> JobAction:
    if job.attempts >= max_attempts:
        return FinishJob(
            job.job_id,
            JobStatus.FAILED,
            None,
            f"{why}; started {job.attempts} times (the limit), not requeued",
        )
    return RequeueJob(job.job_id, f"{why}; requeued (attempt {job.attempts + 1} next)")


def plan_dispatch(
    workers: Iterable[WorkerView],
    jobs: Iterable[JobRecord],
    exits: Mapping[int, JobExit],
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> list[JobAction]:
    """Finish, requeue and start jobs.

    - A running job that exited: SUCCEEDED (0) or FAILED with its code; but one killed by a
      signal while its worker is gone was the worker's loss, not its own: requeued.
    - A running job whose worker is gone: requeued, up to `max_attempts` starts, then FAILED.
    - Queued jobs start in FIFO order (by job id) on the READY worker with the lowest id that
      has room (`slots`, and fewer than MAX_JOBS_PER_WORKER jobs running); the queue's head
      waits for room rather than be overtaken.
    """
    workers = sorted(workers, key=lambda w: w.replica_id)
    alive = {w.replica_id for w in workers if w.alive}
    actions: list[JobAction] = []
    used: dict[ReplicaId, float] = {}
    running: dict[ReplicaId, int] = {}
    pending: list[JobRecord] = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        if job.status is JobStatus.PENDING:
            pending.append(job)
            continue
        if job.status is not JobStatus.RUNNING:
            continue
        worker_gone = job.worker_id not in alive
        done = exits.get(job.job_id)
        killed = done is not None and (done.exit_code < 0 or 128 < done.exit_code <= 192)
        if done is not None and not (worker_gone and (killed or done.lost)):
            ok = done.exit_code == 0 and not done.lost
            actions.append(
                FinishJob(
                    job.job_id,
                    JobStatus.SUCCEEDED if ok else JobStatus.FAILED,
                    done.exit_code,
                    "exited with code 0"
                    if ok
                    else "its process vanished"
                    if done.lost
                    else _exit_reason(done.exit_code),
                )
            )
        elif worker_gone:
            actions.append(_lost(job, f"worker {job.worker_id} was lost", max_attempts))
        else:
            wid = job.worker_id or ReplicaId(0)
            used[wid] = used.get(wid, 0.0) + job.slots
            running[wid] = running.get(wid, 0) + 1
    free = {w.replica_id: w.capacity - used.get(w.replica_id, 0.0) for w in workers if w.ready}
    for job in pending:
        worker = next(
            (
                wid
                for wid, room in free.items()
                if room + 1e-9 >= job.slots and running.get(wid, 0) < MAX_JOBS_PER_WORKER
            ),
            None,
        )
        if worker is None:
            break  # FIFO: the head of the queue waits for room
        free[worker] -= job.slots
        running[worker] = running.get(worker, 0) + 1
        actions.append(StartJob(job.job_id, worker))
    return actions


def _exit_reason(code: int) -> str:
    if 128 < code <= 192:  # bash reports a child killed by signal N as 128 + N
        return f"{_exit_reason(128 - code)} (exit code {code})"
    if code < 0:
        import signal

        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def job_slots(
    worker_cpus: float | None,
    worker_accelerators: float | None,
    job_cpus: float | None,
    job_accelerators: float | None,
) -> float:
    """The share of one worker a job takes (packing): the largest of its CPUs and accelerators
    over the worker's, at least 1 / MAX_JOBS_PER_WORKER; 1 (the whole worker) when the job or
    the pool names neither. Raises
    ValueError when the job asks for more than a worker has."""
    shares = []
    for want, have, what in (
        (job_cpus, worker_cpus, "CPUs"),
        (job_accelerators, worker_accelerators, "accelerators"),
    ):
        if want is None:
            continue
        if have is None:
            return 1.0  # the pool does not say what a worker has: one job per worker
        if want > have + 1e-9:
            raise ValueError(f"the job asks for {want:g} {what}, a worker has {have:g}")
        shares.append(want / have)
    # (never less than one of MAX_JOBS_PER_WORKER: the autoscaler sizes the pool by these
    # shares, and a worker runs no more jobs than that at once)
    return max(*shares, 1 / MAX_JOBS_PER_WORKER) if shares else 1.0


def busy_workers(jobs: Iterable[JobRecord]) -> set[ReplicaId]:
    """Workers running a job: never stopped by a scale-down."""
    return {j.worker_id for j in jobs if j.status is JobStatus.RUNNING and j.worker_id}


@dataclass(frozen=True)
class PoolScale:
    target: int
    queue_long_since: float | None = None
    idle_since: float | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "queue_long_since": self.queue_long_since,
            "idle_since": self.idle_since,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PoolScale:
        def num(key: str) -> float | None:
            v = d.get(key)
            return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

        target = d.get("target")
        return cls(
            target=int(target) if isinstance(target, int) and target >= 0 else 0,
            queue_long_since=num("queue_long_since"),
            idle_since=num("idle_since"),
        )


def pool_target(
    lo: int,
    hi: int,
    threshold: int,
    upscale_delay: float,
    downscale_delay: float,
    state: PoolScale,
    queued: int,
    running_slots: float,
    slots_per_worker: float,
    now: float,
    queued_slots: float | None = None,
) -> PoolScale:
    """Workers a pool wants. Fixed pools (lo == hi) keep their size. An autoscaled pool:

    - up when at least `threshold` jobs have waited for `upscale_delay` (at once from zero
      workers, for any queued job): straight to the workers the running and queued jobs
      fill, not one worker per delay as SkyServe's queue autoscaler does;
    - down to what the running jobs use (never below `lo`) once nothing has been queued and
      some worker idle for `downscale_delay`. Busy workers are never the ones stopped (the
      planner protects them).
    """
    current = min(max(state.target, lo), hi)
    if lo == hi:
        return PoolScale(lo, reason="fixed size")
    per = max(slots_per_worker, 1e-9)
    busy = math.ceil(running_slots / per - 1e-9)
    waiting = queued if queued_slots is None else queued_slots  # packed jobs need less
    needed = min(hi, max(lo, math.ceil((running_slots + waiting) / per - 1e-9)))
    long_queue = queued >= max(1, threshold) or (current == 0 and queued > 0)
    if long_queue and needed > current:
        since = state.queue_long_since if state.queue_long_since is not None else now
        if current == 0 or now - since >= upscale_delay:
            return PoolScale(needed, None, None, f"{queued} jobs queued: {current} -> {needed}")
        return PoolScale(current, since, None, "queue long, waiting out the upscale delay")
    if queued == 0 and busy < current:
        since = state.idle_since if state.idle_since is not None else now
        if now - since >= downscale_delay:
            down = max(lo, busy)
            return PoolScale(down, None, None, f"idle workers: {current} -> {down}")
        return PoolScale(current, None, since, "idle, waiting out the downscale delay")
    return PoolScale(current, None, None, "steady")
