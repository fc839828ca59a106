"""The controller itself: its health (the one route open without the token), its Prometheus
metrics and its own logs and the load balancers'."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from fleetserve._version import __version__
from fleetserve.api.deps import ERRORS, PREFIX, Ctl
from fleetserve.api.models import Health
from fleetserve.core.errors import NotFound
from fleetserve.infra.cgroups import Cgroups
from fleetserve.oshelpers.files import lines_naming, read_lines, while_alive

router = APIRouter()


@router.get(f"{PREFIX}/health", response_model=Health, response_model_exclude_none=True)
async def health(ctl: Ctl, request: Request) -> Health:
    """Open to anyone who can reach the API: whether it answers, its version, its role and a
    hash of its home (a client tells its own controller by it). The pid, the home's path and
    how local processes are stopped only with the token: they tell other local users and the
    network where this user keeps the home and what runs there."""
    answer = Health(
        ok=True, version=__version__, home_hash=request.app.state.home_hash, role=ctl.role
    )
    if not getattr(request.state, "token_ok", False):
        return answer
    cgroups = getattr(ctl.infra, "cgroups", None)  # the local infra's (a fake has none)
    if isinstance(cgroups, Cgroups):
        answer.processes = await asyncio.to_thread(cgroups.describe)
    answer.pid = os.getpid()
    answer.home = str(ctl.settings.home)
    return answer


@router.get("/metrics", include_in_schema=False)
async def metrics(ctl: Ctl) -> Response:
    """The controller's Prometheus metrics (docs/metrics.md), behind the API token."""
    return Response(ctl.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


@router.get(f"{PREFIX}/logs/{{which}}", responses=ERRORS)
async def component_logs(
    ctl: Ctl,
    which: str,
    service: str | None = Query(None, max_length=64),
    follow: bool = False,
    tail: int | None = Query(None, ge=1, le=10_000, description="Only the last N lines"),
) -> StreamingResponse:
    if which not in ("controller", "load-balancer"):
        raise NotFound(f"no log called {which!r}: use controller or load-balancer")
    path = ctl.log_file(which, service)
    if which == "controller" and service is not None:
        ctl.store.service(service)  # a name that is no service's is an error, not silence
        lines = lines_naming(path, service, follow, tail)
    else:
        lines = read_lines(path, follow, tail)
    if follow and service is not None:  # (a service taken down: its follow ends)
        lines = while_alive(lines, ctl.service_alive(service))
    return StreamingResponse(lines, media_type="text/plain")
