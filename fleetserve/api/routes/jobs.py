"""Jobs on a pool's workers (docs/pools.md): launch, list, read, cancel and their logs."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from fleetserve.api.deps import ERRORS, PREFIX, Ctl, ReplicaIdParam, ServiceName
from fleetserve.api.models import CancelJobs, JobInfo, LaunchJobs
from fleetserve.api.views import job_info
from fleetserve.core.errors import InvalidSpec

router = APIRouter()


@router.post(
    f"{PREFIX}/pools/{{name}}/jobs",
    response_model=list[JobInfo],
    status_code=201,
    responses=ERRORS,
)
async def launch_jobs(ctl: Ctl, name: ServiceName, body: LaunchJobs) -> list[JobInfo]:
    jobs = ctl.launch_jobs(name, body.yaml, body.num_jobs, body.envs, body.name)
    return [job_info(j) for j in jobs]


@router.get(f"{PREFIX}/jobs", response_model=list[JobInfo])
async def list_jobs(
    ctl: Ctl,
    pool: str | None = Query(None, max_length=64),
    limit: int = Query(1000, ge=1, le=10_000),
) -> list[JobInfo]:
    return [job_info(j) for j in ctl.store.list_jobs(pool=pool, limit=limit)]


@router.get(f"{PREFIX}/jobs/{{job_id}}", response_model=JobInfo, responses=ERRORS)
async def get_job(ctl: Ctl, job_id: ReplicaIdParam) -> JobInfo:
    return job_info(ctl.store.get_job(job_id))


@router.post(f"{PREFIX}/jobs/cancel", response_model=list[JobInfo], responses=ERRORS)
async def cancel_jobs(ctl: Ctl, body: CancelJobs) -> list[JobInfo]:
    if (body.job_ids is None) == (body.pool is None):
        raise InvalidSpec("name job ids, or a pool (all its unfinished jobs), not both")
    jobs = await ctl.cancel_jobs(body.job_ids, body.pool)
    return [job_info(j) for j in jobs]


@router.get(f"{PREFIX}/jobs/{{job_id}}/logs", responses=ERRORS)
async def job_logs(
    ctl: Ctl,
    job_id: ReplicaIdParam,
    follow: bool = False,
    tail: int | None = Query(None, ge=1, le=10_000),
) -> StreamingResponse:
    return StreamingResponse(ctl.job_logs(job_id, follow, tail), media_type="text/plain")
