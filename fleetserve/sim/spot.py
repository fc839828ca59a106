"""Spot placement on real spot-capacity traces, on a virtual clock (docs/spot.md).

A trace gives, per zone, how many spot instances could be held over time (the SpotHedge paper's
traces, fleetserve/sim/traces/spot). A fleet wants `target` READY replicas. Each step:
  1. a zone whose capacity fell below the spot replicas it holds preempts the excess (newest
     first): they are gone at once, and the placer hears of it;
  2. the policy decides how many spot and on-demand replicas it wants (the controller's own
     `fallback_targets`, SkyServe's FallbackRequestRate), launches what is missing and retires
     what is extra (not-ready ones first); a spot launch into a zone with no free capacity
     fails at once, and the placer hears of that too;
  3. a replica serves `cold_start` seconds after its launch and is billed from its launch.
Measured per policy: cost relative to keeping `target` on-demand replicas, availability (the
share of time with at least `target` READY), requests over capacity (with a request trace),
preemptions, launches and failed launches. The omniscient optimum (knows capacity, no cold
start) bounds what any placer could reach.

Placers are the controller's (fleetserve.policies.spot); even spread and round robin are the
naive baselines, SkyServe's `dynamic_fallback` the one to beat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetserve.policies.autoscaler import spot_split
from fleetserve.policies.spot import Placer, make_placer
from fleetserve.sim.simulator import Trace
from fleetserve.spec.models import ReplicaPolicy

SPOT_TRACES = Path(__file__).parent / "traces" / "spot"

# On-demand and spot prices per hour of one instance of each trace's type. Sources (list
# prices, us-east-1 / us-central1, read 2026-12): AWS p3.2xlarge on-demand $3.06; its spot
# price has hovered near 30% of that ($0.92); GCP a2-ultragpu-8g on-demand $40.55 and spot
# $12.17 (the same ~30%). Only the ratio matters to the relative cost reported.
PRICES: dict[str, tuple[float, float]] = {
    "AWS": (0.92, 3.06),
    "GCP": (12.17, 40.55),
}


@dataclass(frozen=True)
class SpotTrace:
    """Spot capacity per zone: capacity[zone][i] holds during [i*step, (i+1)*step)."""

    name: str
    step: float
    capacity: dict[str, tuple[int, ...]]

    @property
    def zones(self) -> list[str]:
        return sorted(self.capacity)

    @property
    def seconds(self) -> float:
        return self.step * min(len(v) for v in self.capacity.values())

    def at(self, zone: str, t: float) -> int:
        values = self.capacity[zone]
        i = int(t // self.step)
        return values[i] if 0 <= i < len(values) else 0


MAX_TRACE_STEPS = 10_000_000  # decision rounds (of `tick` seconds) one simulation may take
MAX_ZONE_FILE_BYTES = 64 * 1024 * 1024


def load_spot_trace(path: str, duration: float | None = None, start: float = 0.0) -> SpotTrace:
    """A folder of one JSON file per zone (`{"metadata": {"gap_seconds": G}, "data": [...]}`),
    or the name of one shipped with fleetserve (AWS1, AWS2, AWS3, GCP1). `start` and `duration`
    (seconds) cut a slice. Zones of different lengths are cut to the shortest."""
    if not math.isfinite(start) or start < 0:
        raise ValueError(f"--start {start}: seconds from the trace's start, >= 0")
    if duration is not None and (not math.isfinite(duration) or duration <= 0):
        raise ValueError(f"--duration {duration}: seconds, > 0")
    folder = SPOT_TRACES / path if (SPOT_TRACES / path).is_dir() else Path(path)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        known = ", ".join(sorted(p.name for p in SPOT_TRACES.iterdir() if p.is_dir()))
        raise ValueError(f"spot trace {path}: no *.json zone files there (shipped: {known})")
    capacity: dict[str, tuple[int, ...]] = {}
    step = None
    for f in files:
        doc = _zone_file(f)
        gap, data = doc
        if step is not None and gap != step:
            raise ValueError(f"spot trace {path}: its zones have different gap_seconds")
        step = gap
        first = int(start // gap)
        last = None if duration is None else first + max(1, math.ceil(duration / gap))
        capacity[f.stem.split("_")[0]] = tuple(data[first:last])
    assert step is not None
    trace = SpotTrace(Path(path).name, step, capacity)
    if trace.seconds <= 0:
        full = step * min(len(_zone_file(f)[1]) for f in files)
        raise ValueError(
            f"spot trace {path}: nothing left to replay from --start {start:g} s (the trace "
            f"holds {full:g} s)"
        )
    return trace


def _zone_file(f: Path) -> tuple[float, list[int]]:
    """(gap_seconds, capacities) of one zone's file, or ValueError saying what is wrong."""
    if not f.is_file():  # a FIFO or a device would block or never end
        raise ValueError(f"spot trace {f}: not a regular file")
    if f.stat().st_size > MAX_ZONE_FILE_BYTES:
        raise ValueError(f"spot trace {f}: larger than {MAX_ZONE_FILE_BYTES} bytes")
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"spot trace {f}: not readable JSON: {e}") from None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(gap, int | float) or isinstance(gap, bool) or not isinstance(data, list):
        raise ValueError(
            f'spot trace {f}: expected {{"metadata": {{"gap_seconds": G}}, "data": [n, ...]}}'
        )
    if not (math.isfinite(gap) and 0 < gap <= 86400):
        raise ValueError(f"spot trace {f}: gap_seconds must be > 0 and at most a day ({gap})")
    if not data or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in data):
        raise ValueError(f"spot trace {f}: data must be a non-empty list of whole numbers >= 0")
    if gap * len(data) / 60.0 > MAX_TRACE_STEPS:
        raise ValueError(f"spot trace {f}: longer than {MAX_TRACE_STEPS:,} minutes")
    return float(gap), data


def prices_for(trace: SpotTrace) -> tuple[float, float]:
    for prefix, prices in PRICES.items():
        if trace.name.upper().startswith(prefix):
            return prices
    return PRICES["AWS"]


@dataclass
class _Replica:
    spot: bool
    zone: str
    launched: float
    ready_at: float
    fails_at: float | None = None  # a launch into a zone with no capacity: fails then, unbilled


@dataclass
class SpotRun:
    policy: str
    seconds: float = 0.0
    cost: float = 0.0
    on_demand_cost: float = 0.0  # `target` on-demand replicas over the same time
    available_seconds: float = 0.0
    requests: float = 0.0
    over_capacity: float = 0.0
    preemptions: int = 0
    launches: int = 0
    failed_launches: int = 0
    spot_seconds: float = 0.0  # replica-seconds, for the share of spot
    od_seconds: float = 0.0

    @property
    def relative_cost(self) -> float:
        return self.cost / self.on_demand_cost if self.on_demand_cost else 0.0

    @property
    def availability(self) -> float:
        return self.available_seconds / self.seconds if self.seconds else 0.0

    @property
    def over_capacity_share(self) -> float:
        return self.over_capacity / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "relative_cost": round(self.relative_cost, 4),
            "availability": round(self.availability, 4),
            "over_capacity_share": round(self.over_capacity_share, 4),
            "preemptions": self.preemptions,
            "launches": self.launches,
            "failed_launches": self.failed_launches,
            "spot_share": round(
                self.spot_seconds / max(1e-9, self.spot_seconds + self.od_seconds), 4
            ),
        }


SPOT_POLICIES = ("even_spread", "round_robin", "dynamic_fallback", "adaptive")
ALL_POLICIES = ("on_demand", *SPOT_POLICIES, "optimum")


def simulate_spot(
    trace: SpotTrace,
    policy: str,
    target: int | Callable[[float], int] = 4,
    replica_policy: ReplicaPolicy | None = None,
    cold_start: float = 300.0,
    fail_delay: float = 120.0,
    tick: float = 60.0,
    requests: Trace | None = None,
    capacity_qps: float = 1.0,
    seed: int = 0,
) -> SpotRun:
    """One policy over the whole trace. `target` is a number of READY replicas, or a function of
    time (e.g. from a request trace). `replica_policy` supplies SkyServe's fallback settings
    (`base_ondemand_fallback_replicas`, `dynamic_ondemand_fallback`, `num_overprovision`)."""
    if policy not in ALL_POLICIES:
        raise ValueError(f"unknown spot policy {policy!r}: use one of {', '.join(ALL_POLICIES)}")
    rp = replica_policy or ReplicaPolicy(
        min_replicas=1, dynamic_ondemand_fallback=True, num_overprovision=1
    )
    spot_price, od_price = prices_for(trace)
    want = target if callable(target) else (lambda _t, n=target: n)
    run = SpotRun(policy)
    zones = trace.zones
    placer: Placer | None = (
        make_placer(policy, zones, {z: spot_price for z in zones}, seed)
        if policy in SPOT_POLICIES
        else None
    )
    fleet: list[_Replica] = []
    t = 0.0
    end = trace.seconds
    while t < end:
        n = max(0, want(t))
        run.seconds += tick
        run.on_demand_cost += n * od_price * tick / 3600
        if policy == "optimum":
            spot = min(n, sum(trace.at(z, t) for z in zones))
            od = n - spot
            ready = n
        else:
            _fail_launches(fleet, t, placer)
            _preempt(fleet, trace, t, run, placer)
            _act(fleet, policy, n, rp, placer, trace, t, cold_start, fail_delay, run)
            held = [r for r in fleet if r.fails_at is None]  # a failing launch holds nothing
            spot = sum(r.spot for r in held)
            od = len(held) - spot
            ready = sum(r.ready_at <= t for r in fleet)  # a failing launch is never ready
            if placer is not None:
                placer.observe(t, ready_spot=sum(r.spot and r.ready_at <= t for r in fleet))
        run.cost += (spot * spot_price + od * od_price) * tick / 3600
        run.spot_seconds += spot * tick
        run.od_seconds += od * tick
        if ready >= n:
            run.available_seconds += tick
        if requests is not None:
            qps = requests.at(t)
            run.requests += qps * tick
            run.over_capacity += max(0.0, qps - ready * capacity_qps) * tick
        t += tick
    return run


def _fail_launches(fleet: list[_Replica], t: float, placer: Placer | None) -> None:
    for r in [r for r in fleet if r.fails_at is not None and r.fails_at <= t]:
        fleet.remove(r)
        if placer is not None:
            placer.launch_failed(r.zone, t)


def _preempt(
    fleet: list[_Replica], trace: SpotTrace, t: float, run: SpotRun, placer: Placer | None
) -> None:
    for zone in trace.zones:
        held = [r for r in fleet if r.spot and r.zone == zone and r.fails_at is None]
        excess = len(held) - trace.at(zone, t)
        if excess <= 0:
            continue
        held.sort(key=lambda r: r.launched, reverse=True)  # the newest go first
        for r in held[:excess]:
            fleet.remove(r)
            run.preemptions += 1
        if placer is not None:
            placer.preempted(zone, t)


def _act(
    fleet: list[_Replica],
    policy: str,
    n: int,
    rp: ReplicaPolicy,
    placer: Placer | None,
    trace: SpotTrace,
    t: float,
    cold_start: float,
    fail_delay: float,
    run: SpotRun,
) -> None:
    if policy == "on_demand":
        want_spot, want_od = 0, n
    else:
        assert placer is not None
        extra = placer.overprovision(rp.num_overprovision or 0, n, t) if n else 0
        ready_spot = sum(r.spot and r.ready_at <= t and r.fails_at is None for r in fleet)
        split = spot_split(rp, n, extra, placer.fallback_basis(n, extra), ready_spot)
        want_spot, want_od = split.spot, split.on_demand
    spot = [r for r in fleet if r.spot]
    od = [r for r in fleet if not r.spot]
    while len(spot) < want_spot:
        assert placer is not None
        counts = {z: sum(r.zone == z for r in spot) for z in trace.zones}
        zone = placer.select(counts, t)
        if zone is None:
            break
        run.launches += 1
        held = sum(r.zone == zone and r.fails_at is None for r in spot)
        r = _Replica(True, zone, t, t + cold_start)
        if trace.at(zone, t) <= held:  # no free capacity there: the launch will fail
            run.failed_launches += 1
            r.ready_at, r.fails_at = math.inf, t + fail_delay
        fleet.append(r)
        spot.append(r)
    while len(od) < want_od:
        run.launches += 1
        r = _Replica(False, "on-demand", t, t + cold_start)
        fleet.append(r)
        od.append(r)
    for group, keep in ((spot, want_spot), (od, want_od)):
        if len(group) > keep:
            # Retire what serves least: not-ready ones first, then the newest.
            group.sort(key=lambda r: (r.ready_at <= t, -r.launched))
            for r in group[: len(group) - keep]:
                fleet.remove(r)
