"""Zones and fault injection (docs/spot.md): the zones' capacity, preempting a replica or a
zone, and setting the capacity the local infra pretends to have."""

from __future__ import annotations

from fastapi import APIRouter

from fleetserve.api.deps import ERRORS, PREFIX, Ctl
from fleetserve.api.models import ChaosCapacity, ChaosPreempt, Preempted
from fleetserve.core.errors import Conflict, InvalidSpec
from fleetserve.core.types import ReplicaId

router = APIRouter()


@router.get(f"{PREFIX}/zones", responses=ERRORS)
async def zones(ctl: Ctl) -> list[dict[str, object]]:
    return ctl.zones()


@router.post(f"{PREFIX}/chaos/preempt", response_model=list[Preempted], responses=ERRORS)
async def chaos_preempt(ctl: Ctl, body: ChaosPreempt) -> list[dict[str, object]]:
    if (body.replica_id is None) == (body.zone is None):
        raise InvalidSpec("name one replica (replica_id) or one zone (zone), not both")
    rid = None if body.replica_id is None else ReplicaId(body.replica_id)
    lost = ctl.chaos_preempt(body.service, rid, body.zone)
    if body.replica_id is not None and not lost:
        raise Conflict(f"replica {body.replica_id} of {body.service} is not running")
    return lost


@router.post(f"{PREFIX}/chaos/capacity", response_model=list[Preempted], responses=ERRORS)
async def chaos_capacity(ctl: Ctl, body: ChaosCapacity) -> list[dict[str, object]]:
    return ctl.chaos_capacity(dict(body.capacity))
