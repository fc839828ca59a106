"""`fleetserve simulate --engine`: autoscaling policies compared on LLM engine models."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from fleetserve.sim.engine import EngineConfig
from fleetserve.sim.engine_sim import (
    MAX_REQUESTS,
    POLICIES,
    Calibration,
    EngineRun,
    Workload,
    calibrate,
    check_fits,
    engine_policy,
    expected_requests,
    run_engine_fleet,
    target_text,
)
from fleetserve.sim.simulator import Trace
from fleetserve.spec.models import ReplicaPolicy


def parse_params(items: list[str]) -> tuple[EngineConfig, Workload]:
    """`NAME=VALUE` items over EngineConfig's and Workload's fields."""
    fields = {
        "engine": {f.name: f.type for f in dataclasses.fields(EngineConfig)},
        "workload": {f.name: f.type for f in dataclasses.fields(Workload)},
    }
    given: dict[str, dict[str, float | int]] = {"engine": {}, "workload": {}}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        where = next((k for k, names in fields.items() if name in names), None)
        if not sep or where is None:
            known = ", ".join([*fields["engine"], *fields["workload"]])
            raise ValueError(f"--engine-param {item!r}: expected NAME=VALUE, NAME one of {known}")
        try:
            value: float | int = int(raw) if fields[where][name] in ("int", int) else float(raw)
        except ValueError:
            raise ValueError(f"--engine-param {item!r}: {raw!r} is not a number") from None
        given[where][name] = value
    try:
        engine = EngineConfig(**given["engine"])  # type: ignore[arg-type]
        workload = Workload(**given["workload"])  # type: ignore[arg-type]
        check_fits(engine, workload)
    except ValueError as e:
        raise ValueError(f"--engine-param: {e}") from None
    return engine, workload


def parse_targets(items: list[str]) -> dict[str, float]:
    """`POLICY=VALUE` items: targets given instead of the rule's."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in POLICIES:
            raise ValueError(
                f"--engine-target {item!r}: expected POLICY=VALUE, POLICY one of "
                f"{', '.join(POLICIES)}"
            )
        try:
            out[name] = float(raw)
        except ValueError:
            raise ValueError(f"--engine-target {item!r}: {raw!r} is not a number") from None
    return out


def run_engine(
    trace: Trace,
    names: list[str],
    engine: EngineConfig,
    workload: Workload,
    ttft_target_ms: float,
    percentile: float,
    utilization: float,
    min_replicas: int,
    max_replicas: int,
    upscale_delay: float,
    downscale_delay: float,
    window: float,
    cold_start: float,
    seed: int,
    given: dict[str, float] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    move_waiting: bool = False,
) -> tuple[Calibration, list[tuple[EngineRun, str]]]:
    """Calibrate the targets on the engine model, then run each policy over the trace
    (`given`: targets chosen by the user instead of the rule, by policy; `move_waiting`: the
    load balancer moves waiting requests, as `load_balancer.move_waiting_requests`)."""
    given = given or {}
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}: with --engine use {', '.join(POLICIES)}")
    if not names:
        raise ValueError("--policy names no policy")
    if expected_requests(trace) > MAX_REQUESTS:  # before the calibration's seconds
        raise ValueError(
            f"{trace.name}: about {expected_requests(trace):,.0f} requests, more than the "
            f"engine model's bound of {MAX_REQUESTS:,}: use --duration or --scale"
        )
    total = len(names) + 1

    def build(cal: Calibration) -> list[ReplicaPolicy]:
        try:
            return [
                engine_policy(
                    n,
                    cal,
                    min_replicas,
                    max_replicas,
                    upscale_delay,
                    downscale_delay,
                    window,
                    percentile,
                    given.get(n),
                )
                for n in names
            ]
        except ValidationError as e:
            problem = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ValueError(f"--engine-target: {problem}") from None

    build(Calibration(1.0, utilization, 1.0, 1.0, 1.0, 0.5, ttft_target_ms))  # before the run
    if progress is not None:
        progress("capacity of one replica (the targets' rule)", 0, total)
    cal = calibrate(engine, workload, ttft_target_ms, percentile, seed, utilization=utilization)
    policies = build(cal)
    runs = []
    for i, (name, policy) in enumerate(zip(names, policies, strict=True)):
        if progress is not None:
            progress(name, i + 1, total)
        run = run_engine_fleet(
            trace,
            policy,
            name,
            engine,
            workload,
            ttft_target_ms / 1000,
            cold_start,
            seed,
            move=move_waiting,
        )
        runs.append((run, target_text(name, policy) + (" (given)" if name in given else "")))
    return cal, runs


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.0f} s"


def show(
    out: Console,
    trace: Trace,
    cal: Calibration,
    runs: list[tuple[EngineRun, str]],
    engine: EngineConfig,
    workload: Workload,
    percentile: float,
    cold_start: float,
    upscale_delay: float,
    downscale_delay: float,
    seed: int,
    move_waiting: bool = False,
) -> None:
    out.print(
        f"{trace.name}: {trace.seconds / 3600:.1f} h, mean {sum(trace.qps) / len(trace.qps):.2f} "
        f"req/s, peak {max(trace.qps):.2f} req/s; cold start {cold_start:g} s, delays up "
        f"{upscale_delay:g} s / down {downscale_delay:g} s; seed {seed}",
        highlight=False,
    )
    e, w = engine, workload
    out.print(
        f"Engine model: batch {e.max_batch}, KV cache {e.kv_tokens:,} tokens, step = max("
        f"{e.weights_ms:g} ms + {e.kv_ms_per_token:g} ms/context token, "
        f"{e.compute_ms_per_token:g} ms/token computed), prefill {e.max_prefill_tokens} "
        f"tokens/step, prefix hits {100 * e.prefix_hit:g}%; prompts ~{w.prompt_median:g} "
        f"tokens, outputs ~{w.output_median:g} (medians)",
        highlight=False,
    )
    out.print(
        f"Targets by one rule: one replica meets TTFT p{percentile:g} <= "
        f"{cal.ttft_ms:g} ms up to {cal.capacity_qps:.3g} req/s; each signal's target is its "
        f"mean on one replica at {100 * cal.utilization:g}% of that ({cal.qps:.3g} req/s); "
        f"the TTFT policy's is the target itself",
        highlight=False,
    )
    if move_waiting:
        out.print(
            "Load balancer: moves waiting requests (load_balancer.move_waiting_requests) to "
            "READY replicas with none waiting, at each reading of the replicas' metrics",
            highlight=False,
        )
    table = Table(
        title=f"Policies on the same requests (over target: TTFT > {cal.ttft_ms:g} ms or none)",
        title_justify="left",
    )
    columns = [
        "POLICY",
        "TARGET",
        "OVER TARGET",
        "TIMED OUT",
        "TTFT P50",
        "TTFT P99",
        "REPLICA-HOURS",
        "MAX REPLICAS",
        "SCALE EVENTS",
    ]
    if move_waiting:
        columns.append("MOVED")
    for col in columns:
        table.add_column(col)
    for r, target in runs:
        cells = [
            r.policy,
            target,
            f"{r.over_target:,} ({100 * r.over_target_share:.1f}%)",
            f"{r.timed_out:,}",
            _ms(r.ttft_percentile(50)),
            _ms(r.ttft_percentile(99)),
            f"{r.replica_hours:.1f}",
            str(r.max_replicas),
            str(r.scale_events),
        ]
        if move_waiting:
            cells.append(f"{r.moved:,}")
        table.add_row(*cells)
    out.print(table)
