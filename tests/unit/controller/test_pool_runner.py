"""`PoolRunner` on a real store with a fake job runner: a start a controller death cut short
(row RUNNING, no handle) is adopted if its process started, requeued if not; never run twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from fleetserve.controller.pools import PoolRunner
from fleetserve.core.clock import FakeClock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import JobStatus, ReplicaRecord
from fleetserve.infra.base import InstanceKind, InstanceState
from fleetserve.infra.jobs import JobRequest
from fleetserve.spec.loader import parse_spec
from fleetserve.store import Store

from .fakes import create_service

POOL = "pool: {workers: 1}\n"


class FakeJobs:
    def __init__(self, found: str | None) -> None:
        self.found = found
        self.started: list[int] = []

    async def start_job(self, req: JobRequest) -> str:
        self.started.append(req.job_id)
        return f"h{req.job_id}"

    async def poll_job(self, handle: str) -> InstanceState:
        return InstanceState(InstanceKind.RUNNING)

    async def wait_job(self, handle: str) -> None:
        await asyncio.sleep(3600)

    async def stop_job(self, handle: str | None, token: str) -> None:
        return None

    async def job_logs(
        self, pool: str, job_id: int, handle: str | None, follow: bool, tail: int | None
    ) -> AsyncIterator[str]:
        yield ""

    async def find_job(self, pool: str, job_id: int, token: str, worker_handle: str) -> str | None:
        return self.found


def setup(store: Store, clock: FakeClock, found: str | None) -> tuple[PoolRunner, FakeJobs]:
    create_service(store, "p", POOL, clock.now())
    w = store.allocate_replica("p", 1, "local", "wtok", clock.now())
    store.update_replica(w, clock.now(), status=ReplicaStatus.READY, handle='{"dir": "/x"}')
    job = store.add_jobs("p", None, "true", {}, 1, 1.0, ["jtok"], clock.now())[0]
    # What a controller killed between claiming the job and starting its process left.
    store.update_job(job, clock.now(), status=JobStatus.RUNNING, worker_id=1, attempts=1)
    jobs = FakeJobs(found)
    runner = PoolRunner("p", store, clock, jobs, Path("/tmp"), lambda: None)
    return runner, jobs


def spec_of(_v: int) -> object:
    return parse_spec(POOL)


def workers(store: Store) -> list[ReplicaRecord]:
    return store.list_replicas("p")


async def test_an_interrupted_start_whose_process_ran_is_adopted_not_run_again(
    store: Store, clock: FakeClock
) -> None:
    runner, jobs = setup(store, clock, found="h-found")
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    job = store.list_jobs(pool="p")[0]
    assert (job.status, job.handle, job.attempts) == (JobStatus.RUNNING, "h-found", 1)
    assert jobs.started == []  # never started a second time
    runner.close()


async def test_an_interrupted_start_that_never_ran_is_requeued_and_started_once(
    store: Store, clock: FakeClock
) -> None:
    runner, jobs = setup(store, clock, found=None)
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    job = store.list_jobs(pool="p")[0]
    assert (job.status, job.attempts) == (JobStatus.PENDING, 0)
    assert "cut short by a controller restart" in (job.reason or "")
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    job = store.list_jobs(pool="p")[0]
    assert (job.status, job.handle, job.attempts) == (JobStatus.RUNNING, "h1", 1)
    assert jobs.started == [1]
    runner.close()


async def test_jobs_of_a_worker_recorded_on_another_host_are_requeued_never_polled(
    store: Store, clock: FakeClock
) -> None:
    """A takeover from another host: the worker there is lost (fleetserve.infra.host), its
    running job's process is never polled by pid here; the job is requeued, and starts on a
    worker of this host."""
    runner, jobs = setup(store, clock, found=None)
    job = store.list_jobs(pool="p")[0]
    store.update_job(job, clock.now(), handle="h-on-host-a")
    store.update_replica(store.replica("p", 1), clock.now(), host="host-a")
    polled: list[str] = []

    async def poll_job(handle: str) -> InstanceState:
        polled.append(handle)
        return InstanceState(InstanceKind.RUNNING)

    jobs.poll_job = poll_job  # type: ignore[method-assign]
    jobs.host = "host-b"  # type: ignore[attr-defined]
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    job = store.list_jobs(pool="p")[0]
    assert polled == [] and job.status is JobStatus.PENDING
    assert "worker 1 was lost" in (job.reason or "")
    here = store.allocate_replica("p", 1, "local", "wtok2", clock.now())
    store.update_replica(here, clock.now(), status=ReplicaStatus.READY, handle="{}", host="host-b")
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    job = store.list_jobs(pool="p")[0]
    assert (job.status, job.worker_id) == (JobStatus.RUNNING, 2) and jobs.started == [1]
    runner.close()


async def test_a_cancelled_job_whose_process_outlived_a_controller_is_stopped_once(
    store: Store, clock: FakeClock
) -> None:
    """`jobs cancel` marks the job CANCELLED, then stops its process: a controller killed in
    between left the process running, its worker taken for free. The first round after a
    start stops it (a recent one only, and only once)."""
    runner, jobs = setup(store, clock, found=None)
    job = store.list_jobs(pool="p")[0]
    store.update_job(
        job, clock.now(), status=JobStatus.CANCELLED, handle="h-left", ended_at=clock.now()
    )
    old = store.add_jobs("p", None, "true", {}, 1, 1.0, ["otok"], clock.now())[0]
    store.update_job(
        old, clock.now(), status=JobStatus.CANCELLED, handle="h-old", ended_at=clock.now() - 7200
    )
    stopped: list[str | None] = []

    async def stop_job(handle: str | None, token: str) -> None:
        stopped.append(handle)

    jobs.stop_job = stop_job  # type: ignore[method-assign]
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # (stopped in the background)
    await runner.dispatch(spec_of, workers(store))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert stopped == ["h-left"]  # not the one cancelled two hours ago; not twice
    runner.close()
