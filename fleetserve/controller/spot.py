"""`SpotPlacement`: a spot service's placer (fleetserve.policies.spot) in the controller.

It picks the zone of each spot launch, hears of preemptions and launches that found no
capacity, and says how many spot and on-demand replicas the fleet wants (`spot_split`, the
simulator's rule). Its zone marks are in the store after every change, so a restarted
controller keeps them (docs/spot.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from fleetserve.core.clock import Clock
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaId, ReplicaRecord
from fleetserve.infra.base import Location
from fleetserve.policies.autoscaler import FallbackTargets, spot_split
from fleetserve.policies.spot import Placer, make_placer
from fleetserve.spec.models import ReplicaPolicy
from fleetserve.store import Store

log = logging.getLogger("fleetserve.controller")
STATE_KEY = "spot_placer"
DEFAULT_PLACER = "dynamic_fallback"  # SkyServe's, when the YAML names none


def zone_marks(name: str, state: dict[str, Any]) -> str:
    """The placer's zone state in a few words (status and events)."""
    marked = state.get("preempted")
    if isinstance(marked, list):
        return "zones marked PREEMPTED: " + (", ".join(map(str, marked)) or "none")
    risk = state.get("risk")
    if isinstance(risk, dict):
        shown = {z: v for z, v in risk.items() if isinstance(v, int | float) and v >= 0.01}
        text = ", ".join(f"{z}={v:.2f}" for z, v in sorted(shown.items()))
        return "zone risk: " + (text or "none")
    return ""


class SpotPlacement:
    def __init__(
        self,
        service: str,
        store: Store,
        clock: Clock,
        placer: str | None,
        locations: Iterable[Location],
    ) -> None:
        self.service = service
        self.store = store
        self.clock = clock
        self.name = placer or DEFAULT_PLACER
        spot = [loc for loc in locations if loc.spot_capable]
        self.zones = [loc.zone for loc in spot]
        self.placer: Placer = make_placer(
            self.name, self.zones, {loc.zone: loc.spot_price for loc in spot}
        )
        saved = store.get_policy_state(service, STATE_KEY)
        if saved and saved.get("placer") == self.name and isinstance(saved.get("state"), dict):
            self.placer.restore(saved["state"])
        else:
            self.save()  # status shows the placer from the start

    def save(self) -> None:
        state = {"placer": self.name, "state": self.placer.state()}
        self.store.put_policy_state(self.service, STATE_KEY, state, self.clock.now())

    def describe(self) -> str:
        return zone_marks(self.name, self.placer.state())

    def targets(
        self, policy: ReplicaPolicy | None, target: int, replicas: list[ReplicaRecord]
    ) -> FallbackTargets:
        """Spot and on-demand replicas wanted for `target` READY ones (plus the spares)."""
        now = self.clock.now()
        rp = policy or ReplicaPolicy(min_replicas=target)
        ready_spot = sum(r.spot and r.status is ReplicaStatus.READY for r in replicas)
        before = json.dumps(self.placer.state(), sort_keys=True)
        self.placer.observe(now, ready_spot)
        extra = self.placer.overprovision(rp.num_overprovision or 0, target, now) if target else 0
        if json.dumps(self.placer.state(), sort_keys=True) != before:
            self.save()
        return spot_split(rp, target, extra, self.placer.fallback_basis(target, extra), ready_spot)

    def zone_for(self, replicas: Iterable[ReplicaRecord]) -> str | None:
        """Where the next spot launch goes, given the spot replicas held now (None: every
        zone is backing off; the launch waits)."""
        counts: dict[str, int] = {}
        for r in replicas:
            if r.spot and r.zone and not r.status.is_terminal:
                counts[r.zone] = counts.get(r.zone, 0) + 1
        return self.placer.select(counts, self.clock.now())

    def preempted(self, replica_id: ReplicaId, zone: str) -> None:
        self.placer.preempted(zone, self.clock.now())
        self._noted(f"spot replica {replica_id} preempted in zone {zone}", replica_id)

    def launch_failed(self, replica_id: ReplicaId, zone: str, why: str) -> None:
        self.placer.launch_failed(zone, self.clock.now())
        self._noted(f"{why}: replica {replica_id} removed, another will be placed", replica_id)

    def _noted(self, what: str, replica_id: ReplicaId) -> None:
        self.save()
        marks = self.describe()
        message = f"{what}; {self.name} placer: {marks}" if marks else what
        self.store.add_event(self.service, self.clock.now(), "spot", message, replica_id)
        log.info("service %s: %s", self.service, message)
