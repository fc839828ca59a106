"""The FastAPI application: thin handlers over `Controller`, errors mapped in one place."""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as FastApiPath
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.exc import OperationalError

from fleetserve._version import __version__
from fleetserve.api.auth import WRITE_METHODS, ApiGuard, Sessions, allowed_host_names
from fleetserve.api.dashboard import add_dashboard
from fleetserve.api.etag import ETags
from fleetserve.api.models import (
    ApplyPool,
    CancelJobs,
    ChaosCapacity,
    ChaosPreempt,
    CreateService,
    ErrorResponse,
    EventInfo,
    Health,
    HistoryPoint,
    JobInfo,
    LaunchJobs,
    PoolApplied,
    Preempted,
    ReplicaInfo,
    ServiceHistory,
    ServiceInfo,
    UpdateService,
)
from fleetserve.controller.controller import Controller
from fleetserve.controller.history import SERVICE
from fleetserve.controller.pools import STATE_KEY as POOL_KEY
from fleetserve.controller.pools import pool_bounds
from fleetserve.controller.scaling import STATE_KEY as AUTOSCALER_KEY
from fleetserve.core.errors import Conflict, FleetserveError, InvalidSpec, NotFound, Standby
from fleetserve.core.types import JobRecord, ReplicaId, ReplicaRecord, ServiceRecord
from fleetserve.home.folder import ensure_token
from fleetserve.infra.cgroups import Cgroups
from fleetserve.lb.wake import wake_token
from fleetserve.oshelpers.files import lines_naming, read_lines
from fleetserve.spec.compat import compat_warnings
from fleetserve.spec.exposure import lb_host, reachable_host
from fleetserve.spec.loader import parse_spec

log = logging.getLogger("fleetserve.controller")
PREFIX = "/api/v1"
STANDBY_WRITES = frozenset({"/api/v1/dashboard/login-codes", "/ui/login", "/ui/logout"})
# Path parameters are bounded like the fields they name: a service name is at most 64
# characters, a replica id fits the database's integers.
ServiceName = Annotated[str, FastApiPath(min_length=1, max_length=64)]
ReplicaIdParam = Annotated[int, FastApiPath(ge=1, le=2**31 - 1)]
_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (404, 409, 422)
}


def _handle_field(r: ReplicaRecord, key: str) -> object:
    return _handle_fields(r.handle).get(key) if r.handle else None


@functools.lru_cache(maxsize=4096)
def _handle_fields(handle: str) -> dict[str, object]:
    """A handle's JSON fields (read-only). A replica's handle never changes, and a listing
    of every service shows each replica's: parsed once, not twice per replica per call."""
    try:
        parsed = json.loads(handle)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _endpoint_host(ctl: Controller, svc: ServiceRecord) -> str:
    """Where clients reach the endpoint: the address the LB binds, this machine's name when it
    binds every address."""
    bound = lb_host(ctl.spec_of(svc), ctl.infra.name)
    return reachable_host(bound, socket.gethostname())


@dataclass(frozen=True)
class FleetRead:
    """What a listing of every service reads once for all of them (GET /services with a
    hundred services made three reads per service)."""

    replicas: dict[str, list[ReplicaRecord]]
    autoscaler: dict[str, dict[str, Any]]
    pools: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, ctl: Controller) -> FleetRead:
        return cls(
            ctl.store.replicas_by_service(),
            ctl.store.policy_states(AUTOSCALER_KEY),
            ctl.store.policy_states(POOL_KEY),
        )


def service_info(
    ctl: Controller, svc: ServiceRecord, fleet: FleetRead | None = None
) -> ServiceInfo:
    if fleet is None:
        replicas = ctl.store.list_replicas(svc.name)
    else:
        replicas = fleet.replicas.get(svc.name, [])
    spec = ctl.spec_of(svc)
    lo, hi = spec.service.replica_bounds()
    if spec.service.pool is not None:  # a pool's workers
        lo, hi = pool_bounds(spec.service.pool)
        target = ctl.pool_target_of(svc.name, lo, fleet.pools if fleet else None)
        # The stored target is the last round's: within the active version's bounds (`pool
        # apply --workers 1` answered "3 worker(s) wanted", the old size).
        target = min(max(target, lo), hi)
    else:
        target = ctl.target_of(svc.name, lo, fleet.autoscaler if fleet else None)
    return ServiceInfo(
        name=svc.name,
        status=ctl.status_of(svc, replicas).value,
        endpoint=(
            f"{'https' if spec.service.tls else 'http'}://{_endpoint_host(ctl, svc)}:{svc.lb_port}"
            if svc.lb_port and svc.lb_pid
            else None
        ),
        active_version=svc.active_version,
        serving_version=svc.serving_version,
        update_mode=svc.update_mode,
        traffic_percent=svc.traffic_percent,
        created_at=svc.created_at,
        failure_reason=svc.failure_reason,
        load_balancing_policy=spec.service.load_balancing_policy,
        min_replicas=lo,
        max_replicas=hi,
        target_replicas=target,
        replicas=[replica_info(r) for r in replicas],
        spot_placer=ctl.placer_of(svc.name) if spec.uses_spot else None,
    )


@functools.lru_cache(maxsize=8192)
def replica_info(r: ReplicaRecord) -> ReplicaInfo:
    """A replica as the API shows it (read-only: shared between answers). It changes only
    with its row, so each version of a row is made into one once, not at every listing."""
    return ReplicaInfo(
        replica_id=r.replica_id,
        version=r.version,
        status=r.status.value,
        reason=r.reason,
        endpoint=r.endpoint,
        pid=pid if isinstance(pid := _handle_field(r, "pid"), int) else None,
        node=node if isinstance(node := _handle_field(r, "node_id"), str) else None,
        exit_code=r.exit_code,
        created_at=r.created_at,
        launched_at=r.launched_at,
        first_ready_at=r.first_ready_at,
        terminated_at=r.terminated_at,
        zone=r.zone,
        spot=r.spot,
    )


def job_info(j: JobRecord) -> JobInfo:
    return JobInfo(
        job_id=j.job_id,
        pool=j.pool,
        name=j.name,
        batch=j.batch,
        rank=j.rank,
        num_jobs=j.num_jobs,
        status=j.status.value,
        worker_id=j.worker_id,
        attempts=j.attempts,
        exit_code=j.exit_code,
        reason=j.reason,
        created_at=j.created_at,
        started_at=j.started_at,
        ended_at=j.ended_at,
    )


def with_warnings(ctl: Controller, svc: ServiceRecord) -> ServiceInfo:
    """The service, with a line for each field of its YAML that has no effect here."""
    spec = ctl.spec_of(svc)
    lines = compat_warnings(spec, spec.requested_infra() or ctl.infra.name)
    return service_info(ctl, svc).model_copy(update={"warnings": lines})


def create_app(
    controller: Controller,
    on_stopped: Callable[[], None] | None = None,
    token: str | None = None,
    on_started: Callable[[], None] | None = None,
) -> FastAPI:
    """The REST API over `controller`. Every route but /health needs the `token` (see
    fleetserve.api.auth); `None` makes and reads the token file of the controller's home."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await controller.start()
        if on_started is not None:
            on_started()
        yield
        await controller.stop()
        if on_stopped is not None:
            on_stopped()

    async def writes_when_active(request: Request) -> None:
        """A standby serves reads; a write names the active controller (503, kind standby).
        The dashboard's login codes are this controller's own, so a standby makes them too."""
        if request.method in WRITE_METHODS and request.url.path not in STANDBY_WRITES:
            controller.check_active()

    app = FastAPI(
        title="fleetserve",
        version=__version__,
        lifespan=lifespan,
        dependencies=[Depends(writes_when_active)],
        # No /docs, no /redoc: FastAPI's pages load Swagger UI / ReDoc from a CDN (unpinned,
        # no integrity check) into this origin, where the dashboard's session cookie is
        # valid. The schema stays at /openapi.json (behind the token) for any local viewer.
        docs_url=None,
        redoc_url=None,
    )
    ctl = controller

    def wake_secret(name: str) -> str | None:
        """What the service's LB sends with its wake-up call (derived from its secret)."""
        svc = ctl.store.get_service(name)
        return wake_token(svc.lb_secret) if svc is not None and svc.lb_secret else None

    api_token = token if token is not None else ensure_token(ctl.settings.token_file)
    sessions = Sessions(api_token)  # the dashboard's cookies, checked by the guard too
    app.state.sessions = sessions  # and by the connection guard (fleetserve.api.connections)
    add_dashboard(app, api_token, sessions, secure_cookie=ctl.settings.tls_certfile is not None)
    app.add_middleware(ETags)  # inside the guard: only answers it let through are tagged
    app.add_middleware(
        ApiGuard,
        token=api_token,
        sessions=sessions,
        hosts=allowed_host_names(ctl.settings),
        wake_secret=wake_secret,
        max_body=ctl.settings.max_body_bytes,
    )

    async def parsed_off_loop(yaml_text: str) -> None:
        """Parse and check a YAML in a thread, with a deadline: a hostile one can neither
        block the loop that serves every service nor take unbounded time."""
        try:
            await asyncio.wait_for(
                asyncio.to_thread(parse_spec, yaml_text), ctl.settings.parse_timeout
            )
        except TimeoutError:
            raise InvalidSpec(
                f"the YAML took longer than {ctl.settings.parse_timeout:g} s to parse"
            ) from None

    @app.exception_handler(OperationalError)
    async def _database_error(_req: Request, exc: OperationalError) -> JSONResponse:
        text = " ".join(str(exc.orig).split())  # one line (PostgreSQL's span several)
        if "full" in text or "No space left" in text:  # SQLite's words; PostgreSQL's
            message, status = f"database or disk is full: {ctl.store.where}", 507
        else:
            message, status = f"the database failed: {text}", 503
        return JSONResponse({"error": {"kind": "storage", "message": message}}, status)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in an API call")
        return JSONResponse(
            {"error": {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"[:300]}},
            status_code=500,
        )

    @app.exception_handler(OSError)
    async def _os_error(_req: Request, exc: OSError) -> JSONResponse:
        if exc.errno == errno.ENOSPC:
            message, status = f"disk is full: {exc.filename or ctl.settings.home}", 507
        else:
            message, status = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 500
        return JSONResponse({"error": {"kind": "storage", "message": message}}, status)

    @app.exception_handler(FleetserveError)
    async def _fleetserve_error(_req: Request, exc: FleetserveError) -> JSONResponse:
        error: dict[str, object] = {"kind": exc.kind, "message": exc.message}
        if isinstance(exc, Standby) and exc.active:
            error["active"] = exc.active  # where writes go
        return JSONResponse({"error": error}, status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _bad_payload(_req: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(
            {"error": {"kind": "invalid_spec", "message": f"invalid request: {problems}"}},
            status_code=422,
        )

    @app.get(f"{PREFIX}/health", response_model=Health)
    async def health() -> Health:
        cgroups = getattr(ctl.infra, "cgroups", None)  # the local infra's (a fake has none)
        processes = None
        if isinstance(cgroups, Cgroups):
            processes = await asyncio.to_thread(cgroups.describe)
        return Health(
            ok=True,
            version=__version__,
            pid=os.getpid(),
            home=str(ctl.settings.home),
            role=ctl.role,
            processes=processes,
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """The controller's Prometheus metrics (docs/metrics.md), behind the API token."""
        return Response(ctl.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.post(f"{PREFIX}/services", response_model=ServiceInfo, status_code=201, responses=_ERRORS)
    async def create_service(body: CreateService) -> ServiceInfo:
        await parsed_off_loop(body.yaml)
        svc = ctl.create_service(
            body.yaml, body.name, body.base_dir, body.infra, body.envs, body.secrets, body.host
        )
        return with_warnings(ctl, svc)

    @app.get(f"{PREFIX}/services", response_model=list[ServiceInfo])
    async def list_services() -> list[ServiceInfo]:
        services = ctl.store.list_services()
        fleet = FleetRead.of(ctl)
        return [service_info(ctl, s, fleet) for s in services]

    @app.get(f"{PREFIX}/services/{{name}}", response_model=ServiceInfo, responses=_ERRORS)
    async def get_service(name: ServiceName) -> ServiceInfo:
        return service_info(ctl, ctl.store.service(name))

    @app.get(
        f"{PREFIX}/services/{{name}}/events", response_model=list[EventInfo], responses=_ERRORS
    )
    async def events(
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

    @app.delete(
        f"{PREFIX}/services/{{name}}",
        response_model=ServiceInfo,
        status_code=202,
        responses=_ERRORS,
    )
    async def delete_service(name: ServiceName, purge: bool = False) -> ServiceInfo:
        return service_info(ctl, await ctl.down_service(name, purge))

    @app.post(
        f"{PREFIX}/services/{{name}}/replicas/{{replica_id}}/terminate",
        status_code=202,
        responses=_ERRORS,
    )
    async def terminate_replica(
        name: ServiceName, replica_id: ReplicaIdParam, purge: bool = False
    ) -> dict[str, str]:
        ctl.terminate_replica(name, ReplicaId(replica_id), purge)
        return {"status": "terminating"}

    @app.get(f"{PREFIX}/zones", responses=_ERRORS)
    async def zones() -> list[dict[str, object]]:
        return ctl.zones()

    @app.post(f"{PREFIX}/chaos/preempt", response_model=list[Preempted], responses=_ERRORS)
    async def chaos_preempt(body: ChaosPreempt) -> list[dict[str, object]]:
        if (body.replica_id is None) == (body.zone is None):
            raise InvalidSpec("name one replica (replica_id) or one zone (zone), not both")
        rid = None if body.replica_id is None else ReplicaId(body.replica_id)
        lost = ctl.chaos_preempt(body.service, rid, body.zone)
        if body.replica_id is not None and not lost:
            raise Conflict(f"replica {body.replica_id} of {body.service} is not running")
        return lost

    @app.post(f"{PREFIX}/chaos/capacity", response_model=list[Preempted], responses=_ERRORS)
    async def chaos_capacity(body: ChaosCapacity) -> list[dict[str, object]]:
        return ctl.chaos_capacity(dict(body.capacity))

    @app.post(f"{PREFIX}/services/{{name}}/update", response_model=ServiceInfo, responses=_ERRORS)
    async def update_service(name: ServiceName, body: UpdateService) -> ServiceInfo:
        await parsed_off_loop(body.yaml)
        svc = ctl.update_service(
            name,
            body.yaml,
            body.base_dir,
            body.mode,
            body.traffic_percent,
            body.envs,
            body.secrets,
        )
        return with_warnings(ctl, svc)

    @app.post(f"{PREFIX}/services/{{name}}/rollback", response_model=ServiceInfo, responses=_ERRORS)
    async def rollback(name: ServiceName) -> ServiceInfo:
        return service_info(ctl, ctl.rollback(name))

    @app.post(f"{PREFIX}/services/{{name}}/promote", response_model=ServiceInfo, responses=_ERRORS)
    async def promote(name: ServiceName) -> ServiceInfo:
        return service_info(ctl, ctl.promote(name))

    @app.post(f"{PREFIX}/services/{{name}}/wake", status_code=202, responses=_ERRORS)
    async def wake(name: ServiceName) -> dict[str, str]:
        """Called by the load balancer when it holds a request and no replica is ready."""
        ctl.wake(name)
        return {"status": "waking"}

    @app.get(f"{PREFIX}/services/{{name}}/load", responses=_ERRORS)
    async def load(name: ServiceName) -> dict[str, object]:
        """The load balancer's latest load report (request rates, in-flight per replica)."""
        report = ctl.load_report(name)
        return {"service": name, "report": None if report is None else report.model_dump()}

    @app.get(
        f"{PREFIX}/services/{{name}}/history", response_model=ServiceHistory, responses=_ERRORS
    )
    async def history(
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

    @app.get(f"{PREFIX}/services/{{name}}/replicas/{{replica_id}}/logs", responses=_ERRORS)
    async def replica_logs(
        name: ServiceName,
        replica_id: ReplicaIdParam,
        follow: bool = False,
        tail: int | None = Query(None, ge=1, le=10_000, description="Only the last N lines"),
    ) -> StreamingResponse:
        lines = ctl.replica_logs(name, ReplicaId(replica_id), follow, tail)
        return StreamingResponse(lines, media_type="text/plain")

    # -- pools and jobs (docs/pools.md) ----------------------------------------------------

    def pool_view(name: str) -> ServiceInfo:
        return service_info(ctl, ctl.pool(name))

    @app.put(f"{PREFIX}/pools/{{name}}", response_model=PoolApplied, responses=_ERRORS)
    async def apply_pool(name: ServiceName, body: ApplyPool) -> PoolApplied:
        if body.yaml is not None:
            await parsed_off_loop(body.yaml)
        svc, action, note = ctl.apply_pool(
            name, body.yaml, body.workers, body.base_dir, body.envs, body.secrets
        )
        return PoolApplied(pool=service_info(ctl, svc), action=action, note=note)

    @app.get(f"{PREFIX}/pools", response_model=list[ServiceInfo])
    async def list_pools() -> list[ServiceInfo]:
        services = ctl.store.list_services()
        fleet = FleetRead.of(ctl)
        return [
            service_info(ctl, s, fleet) for s in services if ctl.spec_of(s).service.pool is not None
        ]

    @app.get(f"{PREFIX}/pools/{{name}}", response_model=ServiceInfo, responses=_ERRORS)
    async def get_pool(name: ServiceName) -> ServiceInfo:
        return pool_view(name)

    @app.delete(f"{PREFIX}/pools/{{name}}", response_model=ServiceInfo, responses=_ERRORS)
    async def delete_pool(
        name: ServiceName, purge: bool = False, cancel_jobs: bool = False
    ) -> ServiceInfo:
        return service_info(ctl, await ctl.delete_pool(name, purge, cancel_jobs))

    @app.post(
        f"{PREFIX}/pools/{{name}}/jobs",
        response_model=list[JobInfo],
        status_code=201,
        responses=_ERRORS,
    )
    async def launch_jobs(name: ServiceName, body: LaunchJobs) -> list[JobInfo]:
        jobs = ctl.launch_jobs(name, body.yaml, body.num_jobs, body.envs, body.name)
        return [job_info(j) for j in jobs]

    @app.get(f"{PREFIX}/jobs", response_model=list[JobInfo])
    async def list_jobs(
        pool: str | None = Query(None, max_length=64),
        limit: int = Query(1000, ge=1, le=10_000),
    ) -> list[JobInfo]:
        return [job_info(j) for j in ctl.store.list_jobs(pool=pool, limit=limit)]

    @app.get(f"{PREFIX}/jobs/{{job_id}}", response_model=JobInfo, responses=_ERRORS)
    async def get_job(job_id: ReplicaIdParam) -> JobInfo:
        return job_info(ctl.store.get_job(job_id))

    @app.post(f"{PREFIX}/jobs/cancel", response_model=list[JobInfo], responses=_ERRORS)
    async def cancel_jobs(body: CancelJobs) -> list[JobInfo]:
        if (body.job_ids is None) == (body.pool is None):
            raise InvalidSpec("name job ids, or a pool (all its unfinished jobs), not both")
        jobs = await ctl.cancel_jobs(body.job_ids, body.pool)
        return [job_info(j) for j in jobs]

    @app.get(f"{PREFIX}/jobs/{{job_id}}/logs", responses=_ERRORS)
    async def job_logs(
        job_id: ReplicaIdParam,
        follow: bool = False,
        tail: int | None = Query(None, ge=1, le=10_000),
    ) -> StreamingResponse:
        return StreamingResponse(ctl.job_logs(job_id, follow, tail), media_type="text/plain")

    @app.get(f"{PREFIX}/logs/{{which}}", responses=_ERRORS)
    async def component_logs(
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
        return StreamingResponse(lines, media_type="text/plain")

    return app
