"""What a service did and does: its events, its load balancer's load report and the last
hour of its charts."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Query

from fleetserve.api.deps import ERRORS, PREFIX, Ctl, ServiceName
from fleetserve.api.models import EventInfo, HistoryPoint, ServiceHistory
from fleetserve.controller.history import SERVICE

router = APIRouter()


@router.get(f"{PREFIX}/services/{{name}}/events", response_model=list[EventInfo], responses=ERRORS)
async def events(
    ctl: Ctl,
    name: ServiceName,
    limit: int = Query(50, ge=1, le=1000),
    after: int | None = Query(
        None,
        ge=0,
        le=2**63 - 1,
        description="Only events with an event_id above this, oldest first (up to limit): "
        "poll with the last id seen to follow a service's events",
    ),
) -> list[EventInfo]:
    ctl.store.service(name)
    return [
        EventInfo(
            event_id=e.id,
            at=e.at,
            kind=e.kind,
            message=e.message,
            replica_id=e.replica_id,
            status_from=e.status_from,
            status_to=e.status_to,
        )
        for e in ctl.store.list_events(name, limit, after)
    ]


@router.get(f"{PREFIX}/services/{{name}}/load", responses=ERRORS)
async def load(ctl: Ctl, name: ServiceName) -> dict[str, object]:
    """The load balancer's latest load report (request rates, in-flight per replica)."""
    report = ctl.load_report(name)
    return {"service": name, "report": None if report is None else report.model_dump()}


@router.get(f"{PREFIX}/services/{{name}}/history", response_model=ServiceHistory, responses=ERRORS)
async def history(
    ctl: Ctl,
    name: ServiceName,
    after: float | None = Query(None, ge=0, description="only points later than this time"),
) -> ServiceHistory:
    """The last hour of the service for charts (kept in memory: a restart starts anew)."""
    ctl.store.service(name)
    h = ctl.history_of(name)
    if h is None:
        return ServiceHistory(
            service=name, step_seconds=0, horizon_seconds=0, points=[], replicas={}
        )
    series = h.since(after)

    def points(key: int) -> list[HistoryPoint]:
        return [HistoryPoint(**asdict(p)) for p in series.get(key, [])]

    return ServiceHistory(
        service=name,
        step_seconds=h.step,
        horizon_seconds=h.horizon,
        points=points(SERVICE),
        replicas={str(k): points(k) for k in sorted(series) if k != SERVICE},
    )
