"""What `fleetserve simulate` and `fleetserve pool simulate` print with `-o json|yaml`.

One document per run, told apart by `kind`: `autoscaling` (request-rate autoscalers on a request
trace), `engine` (autoscalers on a request trace served by LLM engine models), `spot` (spot
placers on a spot-capacity trace), `pool` (pool autoscalers on job arrivals). Schema:
docs/schema/v1/simulation.json (docs/output.md); within v1 fields may be added, never renamed
or removed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from fleetserve.sim.engine_sim import Calibration, EngineRun
from fleetserve.sim.pools import PoolRun
from fleetserve.sim.simulator import Run, Trace, intervals
from fleetserve.sim.spot import SpotRun, SpotTrace

SAMPLES = 12  # rows of "ready replicas over time", as the table shows


class AutoscalePolicyResult(BaseModel):
    policy: str
    replica_hours: float = Field(description="Replica-hours launched (billed from launch).")
    over_capacity_requests: float = Field(description="Requests above the READY capacity.")
    over_capacity_share: float = Field(description="Their share of all requests, 0..1.")
    seconds_without_ready: float = Field(description="Seconds with no READY replica.")
    max_ready: int = Field(description="The most READY replicas at once.")


class ReadySample(BaseModel):
    time_s: float = Field(description="Seconds from the trace's start (of this interval).")
    qps: float = Field(description="The trace's request rate at that instant.")
    ready: dict[str, int] = Field(description="READY replicas at that instant, per policy.")
    interval_s: float = Field(description="Seconds this sample covers (from time_s).")
    mean_qps: float = Field(description="The trace's mean request rate over the interval.")
    mean_ready: dict[str, float] = Field(
        description="Mean READY replicas over the interval, per policy (what the table shows)."
    )


class AutoscaleSimulation(BaseModel):
    kind: Literal["autoscaling"] = "autoscaling"
    trace: str
    seconds: float = Field(description="Seconds replayed.")
    mean_qps: float
    peak_qps: float
    target_qps: float = Field(description="Requests/s one replica serves.")
    cold_start_s: float
    upscale_delay_s: float
    downscale_delay_s: float
    policies: list[AutoscalePolicyResult]
    samples: list[ReadySample] = Field(
        description=f"At most {SAMPLES} consecutive intervals covering the run."
    )


class EnginePolicyResult(BaseModel):
    policy: str
    target: str = Field(description="The policy's replica_policy key and its value.")
    requests: int
    over_target: int = Field(
        description="Requests whose TTFT was above the target, or that got no first token."
    )
    over_target_share: float = Field(description="Their share of all requests, 0..1.")
    timed_out: int = Field(description="Requests given up by the load balancer's timeouts.")
    ttft_p50_s: float | None = Field(description="Of the requests that got a first token.")
    ttft_p99_s: float | None
    replica_hours: float = Field(description="Replica-hours launched (billed from launch).")
    max_replicas: int = Field(description="The most replicas launched at once.")
    scale_events: int = Field(description="Changes of the autoscaler's target.")
    moved_requests: int | None = Field(
        description="Waiting requests the load balancer moved to another replica "
        "(--move-waiting); null without it."
    )


class EngineTargets(BaseModel):
    capacity_qps: float = Field(
        description="One replica's highest steady rate with TTFT at the percentile <= target."
    )
    utilization: float = Field(description="The share of capacity the targets are set at.")
    target_qps: float
    target_inflight: float
    target_queue: float
    target_kv_cache_usage: float
    target_ttft_ms: float


class EngineSimulation(BaseModel):
    kind: Literal["engine"] = "engine"
    trace: str
    seconds: float = Field(description="Seconds replayed.")
    mean_qps: float
    peak_qps: float
    seed: int
    ttft_target_ms: float = Field(description="A request above it counts as over target.")
    latency_percentile: float
    cold_start_s: float
    upscale_delay_s: float
    downscale_delay_s: float
    engine: dict[str, int | float] = Field(description="The engine model's parameters.")
    workload: dict[str, int | float] = Field(description="The prompt and output lengths' model.")
    move_waiting_requests: bool = Field(
        description="Whether the load balancer moved waiting requests (--move-waiting)."
    )
    targets: EngineTargets
    policies: list[EnginePolicyResult]


class SpotPolicyResult(BaseModel):
    policy: str
    relative_cost: float = Field(description="Cost relative to all on-demand.")
    availability: float = Field(description="Share of time with the target READY, 0..1.")
    over_capacity_share: float
    preemptions: int
    launches: int
    failed_launches: int
    spot_share: float = Field(description="Share of replica-time on spot, 0..1.")
    seeds: int = Field(description="Runs averaged (a placer with random ties runs several).")


class SpotSimulation(BaseModel):
    kind: Literal["spot"] = "spot"
    trace: str
    zones: list[str]
    days: float
    policies: list[SpotPolicyResult]


class PoolPolicyResult(BaseModel):
    policy: str
    jobs: int
    mean_wait_s: float
    p95_wait_s: float
    makespan_s: float
    worker_hours: float
    peak_workers: int


class PoolSimulation(BaseModel):
    kind: Literal["pool"] = "pool"
    jobs: int = Field(description="Jobs that arrived.")
    job_seconds: float = Field(description="Each job's run time.")
    policies: list[PoolPolicyResult]


Simulation = Annotated[
    AutoscaleSimulation | EngineSimulation | SpotSimulation | PoolSimulation,
    Field(discriminator="kind"),
]
SIMULATION = TypeAdapter(Simulation)


def autoscale_simulation(
    trace: Trace,
    runs: list[Run],
    target_qps: float,
    cold_start: float,
    upscale_delay: float,
    downscale_delay: float,
) -> AutoscaleSimulation:
    n = len(runs[0].times) if runs else 0
    times = runs[0].times if runs else []
    step = times[1] - times[0] if len(times) > 1 else 0.0
    return AutoscaleSimulation(
        trace=trace.name,
        seconds=trace.seconds,
        mean_qps=round(sum(trace.qps) / len(trace.qps), 4),
        peak_qps=round(max(trace.qps), 4),
        target_qps=target_qps,
        cold_start_s=cold_start,
        upscale_delay_s=upscale_delay,
        downscale_delay_s=downscale_delay,
        policies=[
            AutoscalePolicyResult(
                policy=r.policy,
                replica_hours=round(r.replica_hours, 4),
                over_capacity_requests=round(r.over_capacity_requests, 1),
                over_capacity_share=round(r.over_capacity_share, 4),
                seconds_without_ready=round(r.seconds_without_ready, 1),
                max_ready=max(r.ready, default=0),
            )
            for r in runs
        ],
        samples=[
            ReadySample(
                time_s=runs[0].times[a],
                qps=round(runs[0].qps[a], 4),
                ready={r.policy: r.ready[a] for r in runs},
                interval_s=round((b - a) * step, 4),
                mean_qps=round(sum(runs[0].qps[a:b]) / (b - a), 4),
                mean_ready={r.policy: round(sum(r.ready[a:b]) / (b - a), 4) for r in runs},
            )
            for a, b in intervals(n, SAMPLES)
        ],
    )


def engine_simulation(
    trace: Trace,
    runs: list[tuple[EngineRun, str]],
    cal: Calibration,
    seed: int,
    percentile: float,
    cold_start: float,
    upscale_delay: float,
    downscale_delay: float,
    engine: dict[str, int | float],
    workload: dict[str, int | float],
    move_waiting: bool = False,
) -> EngineSimulation:
    def p(run: EngineRun, q: float) -> float | None:
        v = run.ttft_percentile(q)
        return None if v is None else round(v, 4)

    return EngineSimulation(
        trace=trace.name,
        seconds=trace.seconds,
        mean_qps=round(sum(trace.qps) / len(trace.qps), 4),
        peak_qps=round(max(trace.qps), 4),
        seed=seed,
        ttft_target_ms=cal.ttft_ms,
        latency_percentile=percentile,
        cold_start_s=cold_start,
        upscale_delay_s=upscale_delay,
        downscale_delay_s=downscale_delay,
        engine=engine,
        workload=workload,
        move_waiting_requests=move_waiting,
        targets=EngineTargets(
            capacity_qps=round(cal.capacity_qps, 4),
            utilization=cal.utilization,
            target_qps=round(cal.qps, 4),
            target_inflight=round(cal.inflight, 4),
            target_queue=round(cal.queue, 4),
            target_kv_cache_usage=round(cal.kv_cache, 4),
            target_ttft_ms=cal.ttft_ms,
        ),
        policies=[
            EnginePolicyResult(
                policy=r.policy,
                target=target,
                requests=r.requests,
                over_target=r.over_target,
                over_target_share=round(r.over_target_share, 4),
                timed_out=r.timed_out,
                ttft_p50_s=p(r, 50),
                ttft_p99_s=p(r, 99),
                replica_hours=round(r.replica_hours, 4),
                max_replicas=r.max_replicas,
                scale_events=r.scale_events,
                moved_requests=r.moved if move_waiting else None,
            )
            for r, target in runs
        ],
    )


def spot_simulation(trace: SpotTrace, results: list[tuple[SpotRun, int]]) -> SpotSimulation:
    return SpotSimulation(
        trace=trace.name,
        zones=trace.zones,
        days=round(trace.seconds / 86400, 2),
        policies=[SpotPolicyResult.model_validate(dict(r.as_dict(), seeds=n)) for r, n in results],
    )


def pool_simulation(runs: list[PoolRun], jobs: int, job_seconds: float) -> PoolSimulation:
    return PoolSimulation(
        jobs=jobs,
        job_seconds=job_seconds,
        policies=[PoolPolicyResult.model_validate(r.as_dict()) for r in runs],
    )
