"""Spot placers: which zone the next spot replica goes to (pure; no I/O, time passed in).

A placer hears of preemptions and failed launches per zone and picks a zone for each spot
launch, given how many spot replicas each zone holds now; it also says how many spot replicas
to keep above the target (overprovision). The controller and the simulator (fleetserve.sim.spot)
call the same code.

- `dynamic_fallback`: SkyServe's SpotHedge placer, as its code does it (docs/spot.md): a zone is
  ACTIVE or PREEMPTED; a preemption or a failed launch marks it PREEMPTED; when fewer than two
  zones are ACTIVE, all are again; the next launch goes to the cheapest ACTIVE zone that holds
  no spot replica, else the cheapest ACTIVE one (ties at random). Overprovision: as configured.
- `adaptive` (fleetserve's): a zone's risk is a recency-weighted count of its preemptions and
  failed launches (each halves in `half_life` seconds); a zone whose launch just failed is left
  alone for a short back-off that doubles with each failure in a row; the next launch goes to
  the zone holding the fewest spot replicas, the least risky of those, then the cheapest.
  On-demand fallback: for a lost spare (overprovision) only within `hedge_window` of a
  preemption, when bursts are likely; otherwise only below the target. Correlated bursts:
  zones preempted within `together` seconds of each other form a correlated group (one such
  group takes several replicas at once, which one spare cannot cover); after `burst_groups`
  groups within `burst_memory`, one more spare spot replica is kept for `burst_spare_for`
  after the latest (a spot spare only: on-demand never stands in for it).
- `even_spread`, `round_robin`: the naive baselines, blind to preemptions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

PLACERS = ("dynamic_fallback", "adaptive", "even_spread", "round_robin")


class Placer:
    """The baseline behaviour: no memory, the configured overprovision."""

    def __init__(self, zones: Sequence[str], prices: Mapping[str, float], seed: int = 0) -> None:
        if not zones:
            raise ValueError("a spot placer needs at least one zone")
        self.zones = list(zones)
        self.prices = {z: prices.get(z, 0.0) for z in self.zones}
        self.rng = random.Random(seed)

    def select(self, counts: Mapping[str, int], now: float) -> str | None:
        raise NotImplementedError

    def preempted(self, zone: str, now: float) -> None:
        """A spot replica in `zone` was preempted."""

    def launch_failed(self, zone: str, now: float) -> None:
        """A spot launch in `zone` found no capacity."""

    def observe(self, now: float, ready_spot: int) -> None:
        """Called once per decision round."""

    def overprovision(self, configured: int, target: int, now: float) -> int:
        """How many spot replicas to keep above the target."""
        return configured

    def fallback_basis(self, target: int, extra: int) -> int:
        """The spot count that on-demand fallback makes up for: SkyServe's counts the
        overprovision too (an on-demand replica starts when a spare spot one is lost)."""
        return target + extra

    def state(self) -> dict[str, object]:
        """What to persist so that a restarted controller keeps the zone marks."""
        return {}

    def restore(self, state: Mapping[str, object]) -> None:
        """The inverse of `state` (unknown or stale keys are ignored)."""


class EvenSpread(Placer):
    def select(self, counts: Mapping[str, int], now: float) -> str | None:
        return min(self.zones, key=lambda z: (counts.get(z, 0), self.zones.index(z)))


class RoundRobin(Placer):
    def __init__(self, zones: Sequence[str], prices: Mapping[str, float], seed: int = 0) -> None:
        super().__init__(zones, prices, seed)
        self.next = 0

    def select(self, counts: Mapping[str, int], now: float) -> str | None:
        zone = self.zones[self.next % len(self.zones)]
        self.next += 1
        return zone


class DynamicFallback(Placer):
    """SkyServe's SpotHedge placer."""

    def __init__(self, zones: Sequence[str], prices: Mapping[str, float], seed: int = 0) -> None:
        super().__init__(zones, prices, seed)
        self.active = {z: True for z in self.zones}

    def _mark(self, zone: str) -> None:
        if zone in self.active:
            self.active[zone] = False
        if sum(self.active.values()) < 2:
            self.active = {z: True for z in self.zones}

    def preempted(self, zone: str, now: float) -> None:
        self._mark(zone)

    def launch_failed(self, zone: str, now: float) -> None:
        self._mark(zone)

    def select(self, counts: Mapping[str, int], now: float) -> str | None:
        active = [z for z in self.zones if self.active[z]]
        unused = [z for z in active if counts.get(z, 0) == 0]
        pool = unused or active
        cheapest = min(self.prices[z] for z in pool)
        return self.rng.choice([z for z in pool if self.prices[z] == cheapest])

    def state(self) -> dict[str, object]:
        return {"preempted": sorted(z for z, a in self.active.items() if not a)}

    def restore(self, state: Mapping[str, object]) -> None:
        marked = state.get("preempted")
        if isinstance(marked, list):
            self.active = {z: z not in marked for z in self.zones}
            if sum(self.active.values()) < 2:
                self.active = {z: True for z in self.zones}


class Adaptive(Placer):
    """fleetserve's placer: recency-weighted zone risk, a short back-off after failed launches,
    on-demand fallback for a lost spare only while preemptions are recent, and one more spare
    spot replica while correlated preemptions (several zones at once) recur."""

    def __init__(
        self,
        zones: Sequence[str],
        prices: Mapping[str, float],
        seed: int = 0,
        half_life: float = 6 * 3600.0,
        backoff: float = 60.0,
        max_backoff: float = 600.0,
        hedge_window: float = 12 * 3600.0,
        together: float = 60.0,
        burst_groups: int = 2,
        burst_memory: float = 6 * 3600.0,
        burst_spare_for: float = 3 * 3600.0,
    ) -> None:
        super().__init__(zones, prices, seed)
        self.half_life = half_life  # a preemption or failed launch counts half after this
        self.backoff = backoff  # a zone whose launch failed is skipped this long, doubling
        self.max_backoff = max_backoff  # ... up to this
        self.hedge_window = hedge_window  # after a preemption, a lost spare gets on-demand
        self.risk = {z: 0.0 for z in self.zones}
        self.risk_at = {z: 0.0 for z in self.zones}
        self.failures_in_row = {z: 0 for z in self.zones}
        self.blocked_until = {z: -math.inf for z in self.zones}
        self.last_preemption = -math.inf
        self.now = 0.0
        self.together = together  # preemptions of zones this close form one correlated group
        self.burst_groups = burst_groups  # this many groups within burst_memory make a burst
        self.burst_memory = burst_memory
        self.burst_spare_for = burst_spare_for  # a burst keeps one more spare this long
        self.recent: list[tuple[str, float]] = []  # (zone, time) of the last preemptions
        self.groups: list[float] = []  # when correlated groups formed, within burst_memory
        self.burst_until = -math.inf
        self.added = 0  # spares overprovision() last added to the configured ones

    def _risk(self, zone: str, now: float) -> float:
        age = max(0.0, now - self.risk_at[zone])
        return float(self.risk[zone] * 0.5 ** (age / self.half_life))

    def _bump(self, zone: str, now: float) -> None:
        if zone in self.risk:
            self.risk[zone] = self._risk(zone, now) + 1.0
            self.risk_at[zone] = now

    def preempted(self, zone: str, now: float) -> None:
        self._bump(zone, now)
        self.last_preemption = now
        self.recent = [(z, t) for z, t in self.recent if 0 <= now - t <= self.together]
        self.recent.append((zone, now))
        if len({z for z, _ in self.recent}) < 2:
            return
        # Another zone lost replicas within `together`: a correlated group (counted once).
        if self.groups and now - self.groups[-1] <= self.together:
            return
        self.groups = [g for g in self.groups if now - g <= self.burst_memory] + [now]
        if len(self.groups) >= self.burst_groups:
            self.burst_until = now + self.burst_spare_for

    def launch_failed(self, zone: str, now: float) -> None:
        self._bump(zone, now)
        if zone in self.failures_in_row:
            k = self.failures_in_row[zone]
            self.failures_in_row[zone] = k + 1
            self.blocked_until[zone] = now + min(self.max_backoff, self.backoff * 2 ** min(k, 32))

    def select(self, counts: Mapping[str, int], now: float) -> str | None:
        open_zones = [z for z in self.zones if self.blocked_until[z] <= now]
        if not open_zones:
            return None  # every zone just refused: on-demand fallback covers meanwhile
        return min(
            open_zones,
            key=lambda z: (counts.get(z, 0), round(self._risk(z, now), 2), self.prices[z], z),
        )

    def observe(self, now: float, ready_spot: int) -> None:
        self.now = now
        # A zone left alone for a whole back-off period starts its streak again.
        for z in self.zones:
            if self.failures_in_row[z] and self.blocked_until[z] <= now - self.max_backoff:
                self.failures_in_row[z] = 0

    def overprovision(self, configured: int, target: int, now: float) -> int:
        # Correlated groups take several replicas at once: while they recur, one more spare.
        self.added = 1 if now <= self.burst_until else 0
        return configured + self.added

    def fallback_basis(self, target: int, extra: int) -> int:
        # Soon after a preemption (they come in bursts) a lost spare is replaced by on-demand
        # at once, as SkyServe does; when spot has been quiet, the spares are the hedge and
        # on-demand starts only when the READY spot replicas fall below the target. The burst
        # spare is spot only: on-demand stands in for the configured spares at most.
        if self.now - self.last_preemption <= self.hedge_window:
            return target + max(0, extra - self.added)
        return target

    def state(self) -> dict[str, object]:
        return {
            "risk": dict(self.risk),
            "risk_at": dict(self.risk_at),
            "failures_in_row": dict(self.failures_in_row),
            "blocked_until": {z: v for z, v in self.blocked_until.items() if v > -math.inf},
            "last_preemption": (self.last_preemption if self.last_preemption > -math.inf else None),
            "recent": [[z, t] for z, t in self.recent],
            "groups": list(self.groups),
            "burst_until": self.burst_until if self.burst_until > -math.inf else None,
            "added": self.added,
        }

    def restore(self, state: Mapping[str, object]) -> None:
        for name in ("risk", "risk_at", "failures_in_row", "blocked_until"):
            saved = state.get(name)
            if isinstance(saved, dict):
                mine = getattr(self, name)
                for z, v in saved.items():
                    if z in mine and isinstance(v, int | float):
                        mine[z] = type(mine[z])(v)
        last = state.get("last_preemption")
        if isinstance(last, int | float):
            self.last_preemption = float(last)
        recent = state.get("recent")
        if isinstance(recent, list):
            self.recent = [
                (str(e[0]), float(e[1]))
                for e in recent
                if isinstance(e, list | tuple)
                and len(e) == 2
                and isinstance(e[0], str)
                and e[0] in self.risk
                and isinstance(e[1], int | float)
            ]
        groups = state.get("groups")
        if isinstance(groups, list):
            self.groups = [float(g) for g in groups if isinstance(g, int | float)]
        until = state.get("burst_until")
        if isinstance(until, int | float):
            self.burst_until = float(until)
        added = state.get("added")
        if added in (0, 1):
            self.added = int(added)


def make_placer(
    name: str, zones: Sequence[str], prices: Mapping[str, float], seed: int = 0
) -> Placer:
    kinds: dict[str, type[Placer]] = {
        "dynamic_fallback": DynamicFallback,
        "adaptive": Adaptive,
        "even_spread": EvenSpread,
        "round_robin": RoundRobin,
    }
    if name not in kinds:
        raise ValueError(f"unknown spot placer {name!r}: use one of {', '.join(PLACERS)}")
    return kinds[name](zones, prices, seed)
