"""Pools of workers (docs/pools.md): apply, list, read and delete."""

from __future__ import annotations

from fastapi import APIRouter

from fleetserve.api.deps import ERRORS, PREFIX, Ctl, ServiceName, parsed_off_loop
from fleetserve.api.models import ApplyPool, PoolApplied, ServiceInfo
from fleetserve.api.views import FleetRead, service_info

router = APIRouter()


@router.put(f"{PREFIX}/pools/{{name}}", response_model=PoolApplied, responses=ERRORS)
async def apply_pool(ctl: Ctl, name: ServiceName, body: ApplyPool) -> PoolApplied:
    if body.yaml is not None:
        await parsed_off_loop(ctl, body.yaml)
    svc, action, note = ctl.apply_pool(
        name, body.yaml, body.workers, body.base_dir, body.envs, body.secrets
    )
    return PoolApplied(pool=service_info(ctl, svc), action=action, note=note)


@router.get(f"{PREFIX}/pools", response_model=list[ServiceInfo])
async def list_pools(ctl: Ctl) -> list[ServiceInfo]:
    services = ctl.store.list_services()
    fleet = FleetRead.of(ctl)
    return [
        service_info(ctl, s, fleet) for s in services if ctl.spec_of(s).service.pool is not None
    ]


@router.get(f"{PREFIX}/pools/{{name}}", response_model=ServiceInfo, responses=ERRORS)
async def get_pool(ctl: Ctl, name: ServiceName) -> ServiceInfo:
    return service_info(ctl, ctl.pool(name))


@router.delete(f"{PREFIX}/pools/{{name}}", response_model=ServiceInfo, responses=ERRORS)
async def delete_pool(
    ctl: Ctl, name: ServiceName, purge: bool = False, cancel_jobs: bool = False
) -> ServiceInfo:
    return service_info(ctl, await ctl.delete_pool(name, purge, cancel_jobs))
