"""A service's replicas: terminate one, read its logs."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from fleetserve.api.deps import ERRORS, PREFIX, Ctl, ReplicaIdParam, ServiceName
from fleetserve.core.types import ReplicaId

router = APIRouter()


@router.post(
    f"{PREFIX}/services/{{name}}/replicas/{{replica_id}}/terminate",
    status_code=202,
    responses=ERRORS,
)
async def terminate_replica(
    ctl: Ctl, name: ServiceName, replica_id: ReplicaIdParam, purge: bool = False
) -> dict[str, str]:
    ctl.terminate_replica(name, ReplicaId(replica_id), purge)
    return {"status": "terminating"}


@router.get(f"{PREFIX}/services/{{name}}/replicas/{{replica_id}}/logs", responses=ERRORS)
async def replica_logs(
    ctl: Ctl,
    name: ServiceName,
    replica_id: ReplicaIdParam,
    follow: bool = False,
    tail: int | None = Query(None, ge=1, le=10_000, description="Only the last N lines"),
) -> StreamingResponse:
    lines = ctl.replica_logs(name, ReplicaId(replica_id), follow, tail)
    return StreamingResponse(lines, media_type="text/plain")
