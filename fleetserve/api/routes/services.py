"""Services: create, list, read, update, roll back, promote, wake and take down."""

from __future__ import annotations

from fastapi import APIRouter

from fleetserve.api.deps import ERRORS, PREFIX, Ctl, ServiceName, parsed_off_loop
from fleetserve.api.models import CreateService, ServiceInfo, UpdateService
from fleetserve.api.views import FleetRead, service_info, with_warnings

router = APIRouter()


@router.post(f"{PREFIX}/services", response_model=ServiceInfo, status_code=201, responses=ERRORS)
async def create_service(ctl: Ctl, body: CreateService) -> ServiceInfo:
    await parsed_off_loop(ctl, body.yaml)
    svc = ctl.create_service(
        body.yaml, body.name, body.base_dir, body.infra, body.envs, body.secrets, body.host
    )
    return with_warnings(ctl, svc)


@router.get(f"{PREFIX}/services", response_model=list[ServiceInfo])
async def list_services(ctl: Ctl) -> list[ServiceInfo]:
    services = ctl.store.list_services()
    fleet = FleetRead.of(ctl)
    return [service_info(ctl, s, fleet) for s in services]


@router.get(f"{PREFIX}/services/{{name}}", response_model=ServiceInfo, responses=ERRORS)
async def get_service(ctl: Ctl, name: ServiceName) -> ServiceInfo:
    return service_info(ctl, ctl.store.service(name))


@router.delete(
    f"{PREFIX}/services/{{name}}",
    response_model=ServiceInfo,
    status_code=202,
    responses=ERRORS,
)
async def delete_service(ctl: Ctl, name: ServiceName, purge: bool = False) -> ServiceInfo:
    return service_info(ctl, await ctl.down_service(name, purge))


@router.post(f"{PREFIX}/services/{{name}}/update", response_model=ServiceInfo, responses=ERRORS)
async def update_service(ctl: Ctl, name: ServiceName, body: UpdateService) -> ServiceInfo:
    await parsed_off_loop(ctl, body.yaml)
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


@router.post(f"{PREFIX}/services/{{name}}/rollback", response_model=ServiceInfo, responses=ERRORS)
async def rollback(ctl: Ctl, name: ServiceName) -> ServiceInfo:
    return service_info(ctl, ctl.rollback(name))


@router.post(f"{PREFIX}/services/{{name}}/promote", response_model=ServiceInfo, responses=ERRORS)
async def promote(ctl: Ctl, name: ServiceName) -> ServiceInfo:
    return service_info(ctl, ctl.promote(name))


@router.post(f"{PREFIX}/services/{{name}}/wake", status_code=202, responses=ERRORS)
async def wake(ctl: Ctl, name: ServiceName) -> dict[str, str]:
    """Called by the load balancer when it holds a request and no replica is ready."""
    ctl.wake(name)
    return {"status": "waking"}
