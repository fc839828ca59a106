"""`PoolRunner`: the job side of a worker pool's reconciler (docs/pools.md).

Each round it polls the running jobs, asks the pure planner (fleetserve.policies.jobs) what
to finish, requeue and start, and applies that: starts job processes on the workers, writes
the jobs' rows, and watches each running job so that its end wakes the reconciler at once (a
free worker gets the next job within milliseconds, not at the next round). It also says how
many workers the queue wants and which workers are busy (never scaled down).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from fleetserve.core.clock import Clock
from fleetserve.core.errors import FleetserveError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import JobRecord, JobStatus, ReplicaId, ReplicaRecord
from fleetserve.infra.base import InstanceKind
from fleetserve.infra.host import elsewhere, host_of
from fleetserve.infra.jobs import JobRequest, JobRunner, WorkerBroken
from fleetserve.policies.jobs import (
    DEFAULT_DOWNSCALE_DELAY,
    DEFAULT_UPSCALE_DELAY,
    MAX_JOBS_PER_WORKER,
    FinishJob,
    JobExit,
    PoolScale,
    RequeueJob,
    StartJob,
    WorkerView,
    busy_workers,
    plan_dispatch,
    pool_target,
)
from fleetserve.spec.models import Pool, ServiceTask
from fleetserve.spec.task_env import spec_gpus, task_env
from fleetserve.store import Store

log = logging.getLogger("fleetserve.controller")
STATE_KEY = "pool_autoscaler"
WORKER_RUN = "exec sleep infinity"  # a worker's `run`: it stays up; jobs bring their own
ACTIVE = (JobStatus.PENDING, JobStatus.RUNNING)
# After a (re)start, the newest cancelled jobs are checked once for a process still running
# (a cancel marks the job, then stops its process: a controller killed in between left it).
RECHECK_CANCELLED = 256
RECHECK_CANCELLED_SECONDS = 3600.0
QUEUE_HEAD = 512  # queued jobs read per round (more than the free slots of any round)


def job_envs(
    spec: ServiceTask, job: JobRecord, home: Path, worker: ReplicaRecord | None = None
) -> dict[str, str]:
    """A job's environment: the pool's envs and secrets, the job's own, its rank, and
    SkyPilot's task variables for its worker (a single node: its address, its GPUs)."""
    envs = {k: "" if v is None else str(v) for k, v in {**spec.envs, **spec.secrets}.items()}
    node = "127.0.0.1"
    if worker is not None and worker.endpoint:
        node = urlsplit(worker.endpoint).hostname or node
    envs.update(
        task_env(
            node,
            spec_gpus(spec),
            f"{job.pool}-{job.worker_id}",
            worker.infra if worker is not None else "local",
            None,
            worker.zone if worker is not None else None,
            job=job.job_id,
        )
    )
    envs.update(json.loads(job.envs_json))
    rank = {
        "SKYPILOT_JOB_RANK": str(job.rank),
        "SKYPILOT_NUM_JOBS": str(job.num_jobs),
        "SKYPILOT_JOB_ID": str(job.job_id),
        "FLEETSERVE_JOB_RANK": str(job.rank),
        "FLEETSERVE_NUM_JOBS": str(job.num_jobs),
        "FLEETSERVE_JOB_ID": str(job.job_id),
        "FLEETSERVE_POOL": job.pool,
        "FLEETSERVE_HOME": str(home),
    }
    envs.update(rank)
    if job.worker_id is not None:
        envs["FLEETSERVE_WORKER_ID"] = str(job.worker_id)
    return envs


def pool_bounds(pool: Pool) -> tuple[int, int]:
    return pool.bounds()


class PoolRunner:
    def __init__(
        self,
        pool: str,
        store: Store,
        clock: Clock,
        jobs: JobRunner,
        home: Path,
        wake: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.store = store
        self.clock = clock
        self.jobs = jobs
        self.home = home
        self.wake = wake
        self.watchers: dict[int, asyncio.Task[None]] = {}
        self.sweeps: set[asyncio.Task[None]] = set()
        # Workers recorded on another host (a takeover from there): their jobs are never
        # polled here (a pid of theirs means nothing on this host); they are requeued.
        self.away: set[int] = set()
        self._cancels_checked = False
        # A worker that cannot take jobs: the reconciler replaces it.
        self.on_broken: Callable[[ReplicaRecord, str], None] = lambda _w, _why: None

    # -- workers wanted ------------------------------------------------------------------

    def target(self, spec: ServiceTask, workers: list[ReplicaRecord]) -> int:
        pool = spec.service.pool
        assert pool is not None
        lo, hi = pool_bounds(pool)
        # (a job stored before the share's floor counts for the floor: a worker runs no more
        # than MAX_JOBS_PER_WORKER at once)
        queued, queued_slots, running = self.store.job_counts(
            self.pool, min_slots=1 / MAX_JOBS_PER_WORKER
        )
        raw = self.store.get_policy_state(self.pool, STATE_KEY)
        state = PoolScale.from_json(raw) if raw else PoolScale(lo)
        now = self.clock.now()
        new = pool_target(
            lo,
            hi,
            pool.queue_length_threshold or 1,
            (
                pool.upscale_delay_seconds
                if pool.upscale_delay_seconds is not None
                else DEFAULT_UPSCALE_DELAY
            ),
            (
                pool.downscale_delay_seconds
                if pool.downscale_delay_seconds is not None
                else DEFAULT_DOWNSCALE_DELAY
            ),
            state,
            queued,
            running,
            1.0,
            now,
            queued_slots,
        )
        if new.to_json() != state.to_json() or raw is None:
            self.store.put_policy_state(self.pool, STATE_KEY, new.to_json(), now)
        if new.target != state.target:
            message = f"pool autoscaler: workers {state.target} -> {new.target} ({new.reason})"
            self.store.add_event(self.pool, now, "autoscaler", message)
            log.info("pool %s: %s", self.pool, message)
        return new.target

    def busy(self) -> frozenset[ReplicaId]:
        running = self.store.list_jobs(pool=self.pool, statuses=(JobStatus.RUNNING,))
        return frozenset(busy_workers(running))

    # -- one round -------------------------------------------------------------------------

    async def dispatch(
        self, spec_of: Callable[[int], ServiceTask], workers: list[ReplicaRecord]
    ) -> None:
        # The running jobs, and only the head of the queue: a round costs the same with ten
        # thousand jobs queued (the planner never looks past the first that does not fit).
        mine = host_of(self.jobs)
        self.away |= {w.replica_id for w in workers if elsewhere(w.host, mine)}
        if not self._cancels_checked:
            await self._stop_cancelled()
        jobs = self.store.list_jobs(pool=self.pool, statuses=(JobStatus.RUNNING,))
        jobs += self.store.list_jobs(
            pool=self.pool, statuses=(JobStatus.PENDING,), first=QUEUE_HEAD
        )
        if not jobs:
            return
        by_worker = {w.replica_id: w for w in workers if w.replica_id not in self.away}
        interrupted = [j for j in jobs if j.status is JobStatus.RUNNING and not j.handle]
        for job in interrupted:
            await self._recover_start(job, by_worker.get(job.worker_id or ReplicaId(0)))
        if interrupted:
            return  # the next round plans with what was found (a wake-up is due)
        exits: dict[int, JobExit] = {}
        for job in jobs:
            if job.worker_id in self.away:
                continue  # its worker (lost with its host) is gone: the job is requeued
            if job.status is JobStatus.RUNNING and job.handle:
                state = await self.jobs.poll_job(job.handle)
                if state.kind is InstanceKind.EXITED and state.exit_code is not None:
                    exits[job.job_id] = JobExit(state.exit_code)
                elif state.kind is InstanceKind.LOST:
                    exits[job.job_id] = JobExit(-9, lost=True)
                elif job.job_id not in self.watchers:
                    self._watch(job)  # adopted after a restart: its end wakes us too
        views = [
            WorkerView(
                w.replica_id,
                ready=w.status is ReplicaStatus.READY,
                alive=w.status in (ReplicaStatus.READY, ReplicaStatus.NOT_READY)
                or (w.status is ReplicaStatus.STARTING),
            )
            for w in workers
            if w.replica_id not in self.away
        ]
        by_id = {j.job_id: j for j in jobs}
        by_worker = {w.replica_id: w for w in workers}
        now = self.clock.now()
        for action in plan_dispatch(views, jobs, exits):
            job = by_id[action.job_id]
            if isinstance(action, FinishJob):
                self._sweep_job(job)
                self.store.update_job(
                    job,
                    now,
                    expect=JobStatus.RUNNING,
                    status=action.status,
                    exit_code=action.exit_code,
                    reason=action.reason,
                    ended_at=now,
                )
            elif isinstance(action, RequeueJob):
                self.store.update_job(
                    job,
                    now,
                    expect=JobStatus.RUNNING,
                    status=JobStatus.PENDING,
                    reason=action.reason,
                    worker_id=None,
                    handle=None,
                    started_at=None,
                )
                self.wake()
            elif isinstance(action, StartJob):
                worker = by_worker[action.worker_id]
                await self._start(job, worker, spec_of(worker.version), now)

    async def _start(
        self, job: JobRecord, worker: ReplicaRecord, spec: ServiceTask, now: float
    ) -> None:
        placed = dataclasses.replace(job, worker_id=worker.replica_id)
        if not worker.handle:
            return
        # The row says RUNNING (on this worker, one more attempt) before the process starts: a
        # controller killed in between finds it on restart (find_job) and never starts it twice.
        claimed = self.store.update_job(
            job,
            now,
            expect=JobStatus.PENDING,
            status=JobStatus.RUNNING,
            worker_id=worker.replica_id,
            handle=None,
            attempts=job.attempts + 1,
            started_at=now,
            reason=f"running on worker {worker.replica_id}",
        )
        if claimed is None:
            return  # cancelled meanwhile
        try:
            handle = await self.jobs.start_job(
                JobRequest(
                    pool=self.pool,
                    job_id=job.job_id,
                    token=job.launch_token,
                    worker_token=worker.launch_token,
                    worker_handle=worker.handle,
                    run=job.run,
                    envs=job_envs(spec, placed, self.home, worker),
                )
            )
        except WorkerBroken as e:
            # Not the job's fault: it goes back to the queue, and the worker is replaced.
            self._unclaim(claimed, job, None)
            self.on_broken(worker, f"cannot take jobs: {e.message}")
            return
        except (OSError, FleetserveError) as e:
            message = e.message if isinstance(e, FleetserveError) else str(e)
            self.store.update_job(
                claimed,
                self.clock.now(),
                expect=JobStatus.RUNNING,
                status=JobStatus.FAILED,
                reason=f"could not start on worker {worker.replica_id}: {message}",
                ended_at=self.clock.now(),
            )
            return
        started = self.store.update_job(
            claimed, self.clock.now(), expect=JobStatus.RUNNING, handle=handle
        )
        if started is None:  # cancelled meanwhile: stop what was started
            await self.jobs.stop_job(handle, job.launch_token)
            return
        self._watch(started)

    def _unclaim(self, claimed: JobRecord, before: JobRecord, reason: str | None) -> None:
        """Back to the queue, the attempt not counted (it never ran)."""
        self.store.update_job(
            claimed,
            self.clock.now(),
            expect=JobStatus.RUNNING,
            status=JobStatus.PENDING,
            worker_id=None,
            handle=None,
            attempts=before.attempts,
            started_at=None,
            reason=reason,
        )

    async def _recover_start(self, job: JobRecord, worker: ReplicaRecord | None) -> None:
        """A RUNNING row with no handle: a controller died between claiming and starting it.
        Its process is adopted if it started (or its exit read if it ended); else requeued."""
        handle = None
        if worker is not None and worker.handle:
            handle = await self.jobs.find_job(
                self.pool, job.job_id, job.launch_token, worker.handle
            )
        if handle is None:
            before = dataclasses.replace(job, attempts=max(0, job.attempts - 1))
            self._unclaim(job, before, "its start was cut short by a controller restart; requeued")
            self.wake()
            return
        adopted = self.store.update_job(
            job, self.clock.now(), expect=JobStatus.RUNNING, handle=handle
        )
        if adopted is not None:
            self._watch(adopted)
            self.wake()

    def _watch(self, job: JobRecord) -> None:
        handle = job.handle
        if not handle:
            return

        async def watch() -> None:
            with contextlib.suppress(Exception):
                await self.jobs.wait_job(handle)
            self.watchers.pop(job.job_id, None)
            self.wake()

        self.watchers[job.job_id] = asyncio.create_task(watch(), name=f"job-{job.job_id}")

    async def _stop_cancelled(self) -> None:
        """Once, on the first round: a job cancelled in the last hour whose process still runs
        is stopped (in the background; its worker is free for the planner meanwhile, as it
        was for the controller that marked it)."""
        self._cancels_checked = True
        horizon = self.clock.now() - RECHECK_CANCELLED_SECONDS
        cancelled = self.store.list_jobs(
            pool=self.pool, statuses=(JobStatus.CANCELLED,), limit=RECHECK_CANCELLED
        )
        for job in cancelled:
            if not job.handle or (job.ended_at or 0.0) < horizon or job.worker_id in self.away:
                continue
            with contextlib.suppress(Exception):
                state = await self.jobs.poll_job(job.handle)
                if state.kind is InstanceKind.RUNNING:
                    log.warning(
                        "pool %s: job %s was cancelled but its process still runs (the "
                        "controller stopped before it): stopping it",
                        self.pool,
                        job.job_id,
                    )
                    self._sweep_job(job)

    def _sweep_job(self, job: JobRecord) -> None:
        """An ended job's leftovers (children it put in the background) are stopped, in the
        background: the next job's start does not wait for it."""
        task = asyncio.create_task(self.jobs.stop_job(job.handle, job.launch_token))
        self.sweeps.add(task)
        task.add_done_callback(self.sweeps.discard)

    def fail_queue(self, why: str) -> None:
        """The pool cannot start workers (launches stopped): queued jobs fail with why, rather
        than wait forever."""
        now = self.clock.now()
        for job in self.store.list_jobs(pool=self.pool, statuses=(JobStatus.PENDING,)):
            self.store.update_job(
                job,
                now,
                expect=JobStatus.PENDING,
                status=JobStatus.FAILED,
                reason=f"the pool has no worker and cannot start one: {why}",
                ended_at=now,
            )

    def end_all(self, why: str) -> None:
        """The pool is gone: no job of it stays queued or running."""
        now = self.clock.now()
        for job in self.store.list_jobs(pool=self.pool, statuses=ACTIVE):
            self.store.update_job(
                job, now, expect=job.status, status=JobStatus.CANCELLED, reason=why, ended_at=now
            )

    def close(self) -> None:
        for task in self.watchers.values():
            task.cancel()
        self.watchers.clear()
