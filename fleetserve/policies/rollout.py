"""`plan_rollout`: how many replicas of the active version to create and which replicas of
older versions to retire, for a fleet at rest, a rolling update, a blue-green update or a
canary. Pure; the fleet planner applies it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleetserve.core.status import SCALE_DOWN_ORDER, ReplicaStatus
from fleetserve.core.types import ReplicaRecord

ROLLING = "rolling"
BLUE_GREEN = "blue_green"
UPDATE_MODES = (ROLLING, BLUE_GREEN)


@dataclass(frozen=True)
class RolloutSettings:
    target: int  # replicas wanted (of the active version, once the rollout is over)
    version: int  # the active version: new replicas launch with it
    mode: str = ROLLING
    max_surge: int = 1  # rolling: replicas above `target` while old and new overlap
    max_unavailable: int = 0  # rolling: READY replicas the fleet may lack meanwhile
    switch_ready: int = 1  # blue-green: READY new replicas before traffic moves
    canary_percent: int | None = None  # canary: the new version's share until promoted


@dataclass(frozen=True)
class RolloutStep:
    create: int  # new replicas of the active version
    retire: tuple[ReplicaRecord, ...]  # replicas to drain and stop, in that order
    complete: bool  # nothing of an older version is left: the active version serves alone
    switch: bool = False  # blue-green: route to the active version only, from now on


def scale_down_order(replicas: Iterable[ReplicaRecord]) -> list[ReplicaRecord]:
    """Least useful first (SkyServe's order): by status (PENDING ... READY), then older
    versions, then the newest id."""
    rank = {status: i for i, status in enumerate(SCALE_DOWN_ORDER)}
    return sorted(
        replicas,
        key=lambda r: (rank.get(r.status, len(rank)), r.version, -r.replica_id),
    )


def plan_rollout(
    alive: Sequence[ReplicaRecord], s: RolloutSettings, launches_stopped: bool
) -> RolloutStep:
    new = [r for r in alive if r.version == s.version]
    old = [r for r in alive if r.version != s.version]
    new_ready = sum(r.status is ReplicaStatus.READY for r in new)
    if not old:
        missing = s.target - len(new)
        if missing >= 0:
            return RolloutStep(0 if launches_stopped else missing, (), True)
        return RolloutStep(0, tuple(scale_down_order(new)[:-missing]), True)
    if s.canary_percent is not None:
        # Both versions serve, split by the load balancer; old keeps the full target.
        want_new = max(1, math.ceil(s.target * s.canary_percent / 100))
        create = 0 if launches_stopped else max(0, want_new - len(new))
        extra_new = scale_down_order(new)[: max(0, len(new) - want_new)]
        extra_old = scale_down_order(old)[: max(0, len(old) - s.target)]
        return RolloutStep(create, tuple(extra_new + extra_old), False)
    create = 0 if launches_stopped else max(0, s.target - len(new))
    if s.mode == BLUE_GREEN:
        if not launches_stopped and new_ready >= min(s.switch_ready, s.target) and s.target > 0:
            return RolloutStep(create, tuple(scale_down_order(old)), False, switch=True)
        return RolloutStep(create, (), False)
    # Rolling: within the surge; an old replica goes as soon as a new one is READY for it.
    create = min(create, max(0, s.target + s.max_surge - len(alive)))
    if launches_stopped:
        return RolloutStep(0, (), False)  # the new version fails: the old one keeps serving
    keep_old = max(0, s.target - new_ready - s.max_unavailable)
    retire = scale_down_order(old)[: max(0, len(old) - keep_old)]
    return RolloutStep(create, tuple(retire), len(retire) == len(old) and new_ready > 0)
