"""Replay a request-rate trace through an autoscaling policy on a virtual clock.

The fleetserve policies are the controller's own code (fleetserve.policies.autoscaler), called
exactly as the controller calls them, once per step. SkyServe's request-rate autoscaler is
modelled from its documented behaviour for comparison: a decision every 20 s on the last 60 s
of requests, with its delays counted in ticks of 20 s.

The fleet model: a launched replica is billed from its launch and serves after `cold_start`
seconds; a ready replica serves `capacity_qps` requests a second; requests above the ready
capacity are "over capacity" (queued, slow or failed in a real fleet). In flight = rate x
latency (Little's law).
"""

from __future__ import annotations

import csv
import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

from fleetserve.policies.autoscaler import AutoscalerState, LoadObservation, autoscale
from fleetserve.spec.models import ReplicaPolicy

TRACES = Path(__file__).parent / "traces"


@dataclass(frozen=True)
class Trace:
    """Request rate over time: qps[i] holds during [i*step, (i+1)*step) seconds."""

    name: str
    step: float
    qps: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return self.step * len(self.qps)

    def at(self, t: float) -> float:
        i = int(t // self.step)
        return self.qps[i] if 0 <= i < len(self.qps) else 0.0


def load_trace(path: str, scale: float = 1.0, duration: float | None = None) -> Trace:
    """A CSV of `time_s,qps`, or of `Time (min),Requests` (requests per minute, as the MAF
    trace). `maf1` names the MAF trace shipped with fleetserve."""
    p = TRACES / "maf1-requests-per-minute.csv" if path == "maf1" else Path(path)
    try:
        rows = list(csv.reader(p.read_text().splitlines()))
    except OSError as e:
        raise ValueError(f"trace {path}: {e.strerror}") from None
    if len(rows) < 3:
        raise ValueError(f"trace {path}: needs a header and at least two rows")
    header = [h.strip().lower() for h in rows[0]]
    per_minute = "min" in header[0]
    times, values = [], []
    for n, row in enumerate(rows[1:], start=2):
        try:
            t, v = float(row[0]), float(row[1])
        except (ValueError, IndexError):
            raise ValueError(f"trace {path}, line {n}: expected two numbers, got {row}") from None
        times.append(t * 60 if per_minute else t)
        values.append((v / 60 if per_minute else v) * scale)
    step = times[1] - times[0]
    if step <= 0:
        raise ValueError(f"trace {path}: times must increase")
    if duration is not None:
        values = values[: max(1, math.ceil(duration / step))]
    return Trace(p.name, step, tuple(values))


def burst_trace(base: float, peak: float, period: float, length: float, duration: float) -> Trace:
    """`base` req/s, with `peak` req/s for `length` seconds every `period` seconds."""
    step = 1.0
    qps = tuple(peak if (i % period) < length else base for i in range(int(duration)))
    return Trace(f"burst {base:g}->{peak:g} every {period:g} s for {length:g} s", step, qps)


@dataclass
class Run:
    policy: str
    times: list[float] = field(default_factory=list)
    qps: list[float] = field(default_factory=list)
    target: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    launched: list[int] = field(default_factory=list)
    over_capacity_requests: float = 0.0
    replica_seconds: float = 0.0
    requests: float = 0.0
    seconds_without_ready: float = 0.0

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600

    @property
    def over_capacity_share(self) -> float:
        return self.over_capacity_requests / self.requests if self.requests else 0.0


class _Fleet:
    def __init__(self, start: int, cold_start: float) -> None:
        self.cold_start = cold_start
        self.launch_times: deque[float] = deque([-cold_start] * start)  # ready at t=0

    def resize(self, target: int, now: float) -> None:
        while len(self.launch_times) < target:
            self.launch_times.append(now)
        while len(self.launch_times) > target:
            # Scale-down takes the not-yet-ready (newest) first, as the controller does.
            self.launch_times.pop()

    def ready(self, now: float) -> int:
        return sum(1 for t in self.launch_times if now - t >= self.cold_start)


def _skyserve_decisions(
    policy: ReplicaPolicy, step: float
) -> Generator[int, tuple[float, float], None]:
    """A generator modelling SkyServe's RequestRateAutoscaler: send it (now, requests this
    step), it yields the target after each step."""
    tick, window_s = 20.0, 60.0
    up_ticks = max(1, int(policy.upscale_delay_seconds / tick))
    down_ticks = max(1, int(policy.downscale_delay_seconds / tick))
    target = policy.min_replicas
    window: deque[tuple[float, float]] = deque()
    up = down = 0
    next_tick = 0.0
    target_qps = policy.target_qps_per_replica
    assert isinstance(target_qps, int | float)
    while True:
        now, requests = yield target + (policy.num_overprovision or 0) if target else 0
        window.append((now, requests))
        while window and window[0][0] <= now - window_s:
            window.popleft()
        if now < next_tick:
            continue
        next_tick = now + tick
        qps = sum(r for _, r in window) / window_s
        raw = min(max(math.ceil(qps / target_qps), policy.min_replicas), policy.effective_max)
        if target == 0 and raw > 0:
            target, up, down = raw, 0, 0
        elif raw > target:
            up, down = up + 1, 0
            if up >= up_ticks:
                target, up = raw, 0
        elif raw < target:
            down, up = down + 1, 0
            if down >= down_ticks:
                target, down = raw, 0
        else:
            up = down = 0


def simulate(
    trace: Trace,
    policy: ReplicaPolicy,
    name: str,
    capacity_qps: float,
    latency: float = 1.0,
    cold_start: float = 60.0,
    step: float = 1.0,
) -> Run:
    """Run one policy (`request_rate`, `in_flight` or `skyserve`) over the trace."""
    run = Run(name)
    fleet = _Fleet(policy.min_replicas, cold_start)
    state = AutoscalerState(target=policy.min_replicas)
    sky = _skyserve_decisions(policy, step) if name == "skyserve" else None
    if sky is not None:
        next(sky)
    t = 0.0
    while t < trace.seconds:
        qps = trace.at(t)
        requests = qps * step
        ready = fleet.ready(t)
        if sky is not None:
            target = sky.send((t, requests))
        else:
            inflight = round(qps * latency)
            queued = 1 if ready == 0 and requests > 0 else 0
            decision = autoscale(
                policy, state, LoadObservation(round(requests), inflight, queued), t
            )
            state, target = decision.state, decision.target
        fleet.resize(target, t)
        capacity = ready * capacity_qps * step
        run.over_capacity_requests += max(0.0, requests - capacity)
        run.requests += requests
        run.replica_seconds += len(fleet.launch_times) * step
        if ready == 0 and requests > 0:
            run.seconds_without_ready += step
        run.times.append(t)
        run.qps.append(qps)
        run.target.append(target)
        run.ready.append(ready)
        run.launched.append(len(fleet.launch_times))
        t += step
    return run


def policy_for(
    name: str,
    min_replicas: int,
    max_replicas: int,
    target_qps: float,
    target_inflight: float,
    upscale_delay: float,
    downscale_delay: float,
    window: float,
) -> ReplicaPolicy:
    common = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "upscale_delay_seconds": upscale_delay,
        "downscale_delay_seconds": downscale_delay,
        "qps_window_seconds": window,
    }
    if name == "in_flight":
        return ReplicaPolicy.model_validate(
            {**common, "target_ongoing_requests_per_replica": target_inflight}
        )
    if name in ("request_rate", "skyserve"):
        if name == "skyserve":
            common["qps_window_seconds"] = 60.0
        return ReplicaPolicy.model_validate({**common, "target_qps_per_replica": target_qps})
    raise ValueError(f"unknown policy {name!r}: use request_rate, in_flight or skyserve")


PLOT_NEEDS = (
    "--plot needs matplotlib, in the extra `sim`: pip install 'fleetserve[sim]' "
    "(in a checkout: pip install -e '.[sim]')"
)


def need_matplotlib() -> None:
    """Raise ValueError(PLOT_NEEDS) unless matplotlib imports: checked before a run, not after
    it (a spot trace takes tens of seconds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        raise ValueError(PLOT_NEEDS) from None


def intervals(n: int, rows: int) -> list[tuple[int, int]]:
    """`rows` (or fewer) consecutive [start, end) slices of n steps, covering all of them:
    the rows of "ready replicas over time", each the mean over its slice, not one instant."""
    if n <= 0:
        return []
    size = max(1, -(-n // rows))
    return [(i, min(n, i + size)) for i in range(0, n, size)]


def plot(runs: list[Run], trace: Trace, capacity_qps: float, out: Path) -> None:
    need_matplotlib()
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    hours = [t / 3600 for t in runs[0].times]
    ax1.plot(hours, runs[0].qps, color="black", linewidth=0.8, label="requests/s")
    ax1.set_ylabel("requests / s")
    ax1.set_title(f"{trace.name}: capacity {capacity_qps:g} req/s per ready replica")
    ax1.legend(loc="upper right")
    for run in runs:
        ax2.step(
            hours,
            run.ready,
            where="post",
            linewidth=1.0,
            label=f"{run.policy}: {run.replica_hours:.1f} replica-h, "
            f"{100 * run.over_capacity_share:.1f}% over capacity",
        )
    ax2.set_ylabel("ready replicas")
    ax2.set_xlabel("hours")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
