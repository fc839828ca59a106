"""Zones of the local infra: declared names, spot and on-demand capacity, prices, and the
bookkeeping of which replica holds what (docs/spot.md).

`FLEETSERVE_LOCAL_ZONES` declares them, inline or as a file:

    FLEETSERVE_LOCAL_ZONES="zone-a,zone-b,zone-c"                 # unlimited capacity
    FLEETSERVE_LOCAL_ZONES="zone-a:spot=2:od=4,zone-b:spot=1:spot_price=0.8"
    FLEETSERVE_LOCAL_ZONES=/path/zones.yaml   # a list of {name, spot, od, spot_price, od_price}

Without it the local infra has one zone, `local`, with unlimited capacity of both kinds. The
capacity of a zone can change at run time (`fleetserve chaos replay` and `chaos capacity`):
a zone whose spot capacity falls below the spot replicas it holds preempts the newest ones,
and a spot launch into a full zone fails with `NoCapacity`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetserve.core.errors import FleetserveError, InvalidSpec, NotFound
from fleetserve.core.types import ReplicaId

# List prices per hour of one AWS p3.2xlarge (us-east-1, read 2026-12): on-demand $3.06, spot
# near 30% of that. The local infra bills nothing; these only rank zones and price reports.
DEFAULT_SPOT_PRICE = 0.92
DEFAULT_OD_PRICE = 3.06
MAX_ZONES = 64
MAX_CAPACITY = 10_000
MAX_ZONES_FILE_BYTES = 64 * 1024
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_KEYS = {"spot": "spot", "od": "od", "spot_price": "spot_price", "od_price": "od_price"}


class NoCapacity(FleetserveError):
    """A launch found no free capacity of its kind in its zone (or, `preempted`, lost its
    host before it finished). Not terminal: the replica's row goes, the spot placer hears of
    the zone, and the planner launches another replica (with the placer's back-off)."""

    def __init__(self, message: str, zone: str, preempted: bool = False) -> None:
        super().__init__(message)
        self.zone = zone
        self.preempted = preempted


@dataclass(frozen=True)
class ZoneConfig:
    name: str
    spot: int | None = None  # spot capacity (instances); None: unlimited
    od: int | None = None  # on-demand capacity; None: unlimited
    spot_price: float = DEFAULT_SPOT_PRICE
    od_price: float = DEFAULT_OD_PRICE


def _capacity(zone: str, key: str, raw: Any) -> int | None:
    if raw is None or raw == "unlimited":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise InvalidSpec(f"zone {zone}: {key} must be a whole number or 'unlimited'")
    try:
        n = int(raw)
    except ValueError:
        raise InvalidSpec(f"zone {zone}: {key}={raw!r} is not a whole number") from None
    if not 0 <= n <= MAX_CAPACITY:
        raise InvalidSpec(f"zone {zone}: {key}={n} must be within 0..{MAX_CAPACITY}")
    return n


def _price(zone: str, key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise InvalidSpec(f"zone {zone}: {key} must be a number (dollars per hour)")
    try:
        v = float(raw)
    except ValueError:
        raise InvalidSpec(f"zone {zone}: {key}={raw!r} is not a number") from None
    if not math.isfinite(v) or not 0 <= v <= 1e6:
        raise InvalidSpec(f"zone {zone}: {key}={raw!r} must be within 0..1000000 dollars/hour")
    return v


def _zone(d: Mapping[str, Any]) -> ZoneConfig:
    name = d.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidSpec(
            f"zone name {name!r}: lowercase letters, digits, '.', '_' or '-', at most 63"
        )
    unknown = sorted(set(d) - {"name", *_KEYS})
    if unknown:
        raise InvalidSpec(
            f"zone {name}: unknown key {unknown[0]!r} (known: name, spot, od, spot_price, od_price)"
        )
    return ZoneConfig(
        name=name,
        spot=_capacity(name, "spot", d.get("spot")),
        od=_capacity(name, "od", d.get("od")),
        spot_price=_price(name, "spot_price", d.get("spot_price", DEFAULT_SPOT_PRICE)),
        od_price=_price(name, "od_price", d.get("od_price", DEFAULT_OD_PRICE)),
    )


def _inline(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, *params = item.split(":")
        d: dict[str, Any] = {"name": name.strip()}
        for p in params:
            key, sep, value = p.partition("=")
            if not sep:
                raise InvalidSpec(f"zone {name}: {p!r} is not key=value (e.g. spot=2)")
            d[key.strip()] = value.strip()
        out.append(d)
    return out


def parse_zones(value: str | None) -> list[ZoneConfig]:
    """The zones `FLEETSERVE_LOCAL_ZONES` declares (one unlimited `local` zone if unset)."""
    if value is None or not value.strip():
        return [ZoneConfig("local")]
    value = value.strip()
    if "/" in value or value.endswith((".yaml", ".yml", ".json")):
        items = _zones_file(Path(value).expanduser())
    else:
        items = _inline(value)
    if not items:
        raise InvalidSpec("FLEETSERVE_LOCAL_ZONES declares no zone")
    if len(items) > MAX_ZONES:
        raise InvalidSpec(f"FLEETSERVE_LOCAL_ZONES: {len(items)} zones, at most {MAX_ZONES}")
    zones = [_zone(d) for d in items]
    names = [z.name for z in zones]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InvalidSpec(f"FLEETSERVE_LOCAL_ZONES: zone {dup} is declared twice")
    return zones


def _zones_file(path: Path) -> list[dict[str, Any]]:
    from fleetserve.spec.yaml_bounded import read_yaml

    try:
        if not path.is_file():
            raise InvalidSpec(f"FLEETSERVE_LOCAL_ZONES: {path} is not a file")
        if path.stat().st_size > MAX_ZONES_FILE_BYTES:
            raise InvalidSpec(f"FLEETSERVE_LOCAL_ZONES: {path} is over {MAX_ZONES_FILE_BYTES} B")
        text = path.read_text()
    except OSError as e:
        raise InvalidSpec(f"FLEETSERVE_LOCAL_ZONES: cannot read {path}: {e.strerror}") from None
    data = read_yaml(text, str(path))
    if isinstance(data, dict) and "zones" in data:
        data = data["zones"]
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise InvalidSpec(
            f"FLEETSERVE_LOCAL_ZONES: {path} must hold a list of zones "
            "({name, spot, od, spot_price, od_price})"
        )
    return data


@dataclass
class Held:
    """A replica the infra holds in a zone."""

    service: str
    replica_id: ReplicaId
    zone: str
    spot: bool
    since: float
    pid: int


@dataclass
class ZoneBook:
    """Capacity per zone, what each replica holds, and the capacity changes at run time."""

    zones: list[ZoneConfig]
    spot_capacity: dict[str, int | None] = field(default_factory=dict)
    held: dict[str, Held] = field(default_factory=dict)  # by launch token

    def __post_init__(self) -> None:
        for z in self.zones:
            self.spot_capacity.setdefault(z.name, z.spot)

    def config(self, zone: str) -> ZoneConfig:
        for z in self.zones:
            if z.name == zone:
                return z
        raise NotFound(f"zone {zone!r} is not one of this infra's ({', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [z.name for z in self.zones]

    def count(self, zone: str, spot: bool) -> int:
        return sum(h.zone == zone and h.spot == spot for h in self.held.values())

    def place(self, zone: str | None, spot: bool) -> str:
        """The zone a launch goes to (checked for free capacity), or `NoCapacity`."""
        if zone is None:
            if spot:
                zone = self.zones[0].name
            else:
                # On demand: the cheapest zone with room.
                free = [z for z in self.zones if z.od is None or self.count(z.name, False) < z.od]
                if not free:
                    raise NoCapacity("no on-demand capacity left in any zone", self.names[0])
                zone = min(free, key=lambda z: (z.od_price, self.names.index(z.name))).name
        cfg = self.config(zone)
        if spot:
            cap = self.spot_capacity.get(zone)
            held = self.count(zone, True)
            if cap is not None and held >= cap:
                raise NoCapacity(
                    f"no spot capacity in zone {zone} (capacity {cap}, {held} held)", zone
                )
        elif cfg.od is not None and self.count(zone, False) >= cfg.od:
            raise NoCapacity(f"no on-demand capacity in zone {zone} (capacity {cfg.od})", zone)
        return zone

    def set_spot_capacity(self, zone: str, capacity: int | None) -> list[tuple[str, Held]]:
        """New spot capacity for a zone; returns the replicas (token, held) it preempts: the
        newest spot replicas beyond the capacity."""
        self.config(zone)
        if capacity is not None and not 0 <= capacity <= MAX_CAPACITY:
            raise InvalidSpec(f"zone {zone}: capacity {capacity} must be within 0..{MAX_CAPACITY}")
        self.spot_capacity[zone] = capacity
        if capacity is None:
            return []
        spot = sorted(
            ((t, h) for t, h in self.held.items() if h.zone == zone and h.spot),
            key=lambda th: th[1].since,
            reverse=True,
        )
        return spot[: max(0, len(spot) - capacity)]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "zone": z.name,
                "spot_capacity": self.spot_capacity.get(z.name),
                "declared_spot_capacity": z.spot,
                "spot_held": self.count(z.name, True),
                "on_demand_capacity": z.od,
                "on_demand_held": self.count(z.name, False),
                "spot_price": z.spot_price,
                "on_demand_price": z.od_price,
            }
            for z in self.zones
        ]
