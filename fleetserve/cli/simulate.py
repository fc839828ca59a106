"""`fleetserve simulate`: the production policies replayed on traces, on a virtual clock.

Two simulations with nothing in common but the clock, each a subcommand:
`simulate autoscale` replays a request trace through autoscaling policies (with --engine, on
LLM engine models) and `simulate spot` places spot replicas on a spot-capacity trace. The
spelling from before the subcommands, `fleetserve simulate --trace ...` (`--spot-trace` for
the spot one), still works and prints the same: options right after `simulate` go to a
hidden command that takes every option of both (`SimulateGroup`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from fleetserve.cli.common import err, fail, out
from fleetserve.cli.output import OutputFormat, OutputOption, emit
from fleetserve.core.errors import InvalidSpec

if TYPE_CHECKING:
    from fleetserve.sim.simulator import Run, Trace

FLAGS = "flags"  # the hidden command of the spelling without a subcommand


class SimulateGroup(TyperGroup):
    """`simulate autoscale|spot ...`; `simulate --an-option ...` goes to the hidden command
    that takes the options of both, as `simulate` did before it had subcommands."""

    @staticmethod
    def route(args: list[str]) -> list[str]:
        """The arguments with the hidden command's name first when they start with an option
        (tests/docs/harness.py parses the documented commands through this too)."""
        if args and args[0].startswith("-") and args[0] != "--help":
            return [FLAGS, *args]
        return args

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's own click Context
        return super().parse_args(ctx, self.route(args))


class FlagsCommand(TyperCommand):
    """The hidden command reads as `simulate` itself in its usage and errors (as before the
    subcommands): its context hangs from the root's, under the group's name."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        if parent is not None:
            info_name, parent = parent.info_name, parent.parent
        return super().make_context(info_name, args, parent=parent, **extra)


simulate_app = typer.Typer(
    cls=SimulateGroup,
    no_args_is_help=True,
    help="Replay traces through the policies on a virtual clock: `simulate autoscale` "
    "(autoscaling policies on a request trace; --engine: on LLM engine models) or `simulate "
    "spot` (spot placers on a spot-capacity trace). `fleetserve simulate --trace ...` and "
    "`fleetserve simulate --spot-trace ...`, the spelling from before, still work.",
)

# The options of both simulations (and of the spelling without a subcommand).
TraceOption = Annotated[
    str | None, typer.Option(help="CSV of time_s,qps (or 'Time (min),Requests'); maf1: MAF")
]
BurstOption = Annotated[
    str | None, typer.Option(help="Generated: BASE:PEAK:PERIOD:LENGTH (req/s, seconds)")
]
DurationOption = Annotated[float | None, typer.Option(help="Seconds of the trace to replay")]
ScaleOption = Annotated[float, typer.Option(help="Multiply the trace's rates")]
TargetQpsOption = Annotated[float, typer.Option(help="Requests/s per replica (its capacity)")]
TargetInflightOption = Annotated[float, typer.Option(help="For in_flight")]
LatencyOption = Annotated[float, typer.Option(help="Seconds per request (in flight = rate x this)")]
MinOption = Annotated[int, typer.Option("--min")]
MaxOption = Annotated[int, typer.Option("--max")]
UpscaleDelayOption = Annotated[float, typer.Option(help="Seconds")]
DownscaleDelayOption = Annotated[float, typer.Option(help="Seconds")]
WindowOption = Annotated[float, typer.Option(help="Request-rate window, seconds")]
StepOption = Annotated[float, typer.Option(help="Seconds between decisions")]
PlotOption = Annotated[Path | None, typer.Option("--plot", help="Write a PNG here")]
EngineOption = Annotated[
    bool,
    typer.Option(
        "--engine",
        help="Serve the trace with LLM engine models (batch, queue, KV cache, prefill and "
        "decode) and compare request_rate,in_flight,queue,kv_cache,ttft on TTFT",
    ),
]
TtftTargetOption = Annotated[
    float, typer.Option(help="With --engine: a request above this TTFT is over target")
]
PercentileOption = Annotated[
    float, typer.Option(help="With --engine: the TTFT percentile the targets are set at")
]
UtilizationOption = Annotated[
    float,
    typer.Option(help="With --engine: the share of a replica's capacity targets are set at"),
]
SeedOption = Annotated[int, typer.Option(help="With --engine: requests and lengths")]
EngineParamOption = Annotated[
    list[str] | None,
    typer.Option(
        help="With --engine: NAME=VALUE of the engine model or the workload "
        "(docs/autoscaling.md), repeatable"
    ),
]
EngineTargetOption = Annotated[
    list[str] | None,
    typer.Option(
        help="With --engine: POLICY=VALUE, a target of your choice instead of the rule's "
        "(e.g. queue=2), repeatable"
    ),
]
MoveWaitingOption = Annotated[
    bool,
    typer.Option(
        "--move-waiting",
        help="With --engine: the load balancer moves waiting requests to READY replicas with "
        "none waiting at each reading of their metrics (load_balancer.move_waiting_requests)",
    ),
]
TargetOption = Annotated[int, typer.Option(help="Without --trace: READY replicas wanted")]
OverprovisionOption = Annotated[int, typer.Option(help="num_overprovision (spare spot replicas)")]
SeedsOption = Annotated[int, typer.Option(help="Runs of a placer with random ties, averaged")]
JsonOption = Annotated[bool, typer.Option("--json", help="The same as -o json")]
AUTOSCALERS = "request_rate,in_flight,skyserve"  # the autoscaling default of --policy


@simulate_app.command("autoscale")
def autoscale(
    ctx: typer.Context,
    trace: TraceOption = None,
    burst: BurstOption = None,
    duration: DurationOption = None,
    scale: ScaleOption = 1.0,
    policies: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Comma-separated: request_rate,in_flight,skyserve (with --engine: "
            "request_rate,in_flight,queue,kv_cache,ttft, all by default)",
        ),
    ] = AUTOSCALERS,
    target_qps: TargetQpsOption = 5.0,
    target_inflight: TargetInflightOption = 5.0,
    latency: LatencyOption = 1.0,
    min_replicas: MinOption = 1,
    max_replicas: MaxOption = 10,
    upscale_delay: UpscaleDelayOption = 300.0,
    downscale_delay: DownscaleDelayOption = 1200.0,
    window: WindowOption = 60.0,
    cold_start: Annotated[float, typer.Option(help="Seconds from launch to READY")] = 60.0,
    step: StepOption = 1.0,
    plot_file: PlotOption = None,
    start: Annotated[float, typer.Option(help="With --engine: seconds of the trace to skip")] = 0.0,
    engine: EngineOption = False,
    ttft_target_ms: TtftTargetOption = 1000.0,
    percentile: PercentileOption = 90.0,
    utilization: UtilizationOption = 0.8,
    seed: SeedOption = 0,
    engine_param: EngineParamOption = None,
    engine_target: EngineTargetOption = None,
    move_waiting: MoveWaitingOption = False,
    as_json: JsonOption = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Replay a request trace (--trace or --burst) through autoscaling policies on a virtual
    clock and compare them: replicas over time, requests over capacity, replica-hours. With
    --engine, each replica is an LLM engine model and policies are compared on time to first
    token. `-o json|yaml` prints the result as data (docs/output.md)."""
    try:
        output = json_alias(as_json, output)
    except InvalidSpec as e:
        raise fail(e) from None
    if engine:
        _simulate_engine(
            ctx,
            trace=trace,
            burst=burst,
            duration=duration,
            scale=scale,
            policies=policies,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            upscale_delay=upscale_delay,
            downscale_delay=downscale_delay,
            window=window,
            cold_start=cold_start,
            ttft_target_ms=ttft_target_ms,
            percentile=percentile,
            utilization=utilization,
            seed=seed,
            engine_param=engine_param or [],
            engine_target=engine_target or [],
            move_waiting=move_waiting,
            start=start,
            plot_file=plot_file,
            spot_trace=None,
            output=output,
        )
        return
    if move_waiting:
        raise fail(InvalidSpec("--move-waiting goes with --engine"))
    # typer carries its own click: its ParameterSource, compared by name.
    if getattr(ctx.get_parameter_source("start"), "name", None) == "COMMANDLINE":
        raise fail(InvalidSpec("--start goes with --engine (or `simulate spot`)"))
    _simulate_autoscale(
        trace=trace,
        burst=burst,
        duration=duration,
        scale=scale,
        policies=policies,
        target_qps=target_qps,
        target_inflight=target_inflight,
        latency=latency,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        upscale_delay=upscale_delay,
        downscale_delay=downscale_delay,
        window=window,
        cold_start=cold_start,
        step=step,
        plot_file=plot_file,
        output=output,
    )


@simulate_app.command("spot")
def spot(
    spot_trace: Annotated[
        str,
        typer.Argument(
            help="A folder of per-zone capacity JSON files, or a shipped trace (AWS1, AWS2, "
            "AWS3, GCP1)",
            metavar="SPOT_TRACE",
        ),
    ],
    trace: Annotated[
        str | None,
        typer.Option(
            help="A request trace that sets the target over time (CSV of time_s,qps, or maf1) "
            "instead of --target"
        ),
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Seconds of the spot trace to replay")
    ] = None,
    start: Annotated[float, typer.Option(help="Seconds of the spot trace to skip")] = 0.0,
    scale: Annotated[float, typer.Option(help="With --trace: multiply its rates")] = 1.0,
    policies: Annotated[
        str | None,
        typer.Option("--policy", help="Comma-separated spot placers (default: all of them)"),
    ] = None,
    target: TargetOption = 4,
    target_qps: Annotated[
        float, typer.Option(help="With --trace: requests/s per replica (its capacity)")
    ] = 5.0,
    min_replicas: Annotated[int, typer.Option("--min", help="With --trace")] = 1,
    max_replicas: Annotated[int, typer.Option("--max", help="With --trace")] = 10,
    cold_start: Annotated[float, typer.Option(help="Seconds from launch to READY")] = 300.0,
    overprovision: OverprovisionOption = 1,
    seeds: SeedsOption = 5,
    plot_file: Annotated[
        Path | None, typer.Option("--plot", help="Write cost against availability here (PNG)")
    ] = None,
    as_json: JsonOption = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Compare spot placers on a spot-capacity trace: cost, availability, preemptions.
    `-o json|yaml` prints the result as data (docs/output.md)."""
    try:
        output = json_alias(as_json, output)
    except InvalidSpec as e:
        raise fail(e) from None
    _simulate_spot(
        spot_trace=spot_trace,
        trace=trace,
        duration=duration,
        start=start,
        scale=scale,
        policies=policies,
        target=target,
        target_qps=target_qps,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        cold_start=cold_start,
        overprovision=overprovision,
        seeds=seeds,
        output=output,
        plot_file=plot_file,
    )


@simulate_app.command(FLAGS, hidden=True, cls=FlagsCommand)
def simulate(
    ctx: typer.Context,
    trace: TraceOption = None,
    burst: BurstOption = None,
    duration: DurationOption = None,
    scale: ScaleOption = 1.0,
    policies: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Comma-separated: request_rate,in_flight,skyserve (with --engine: "
            "request_rate,in_flight,queue,kv_cache,ttft, all by default)",
        ),
    ] = AUTOSCALERS,
    target_qps: TargetQpsOption = 5.0,
    target_inflight: TargetInflightOption = 5.0,
    latency: LatencyOption = 1.0,
    min_replicas: MinOption = 1,
    max_replicas: MaxOption = 10,
    upscale_delay: UpscaleDelayOption = 300.0,
    downscale_delay: DownscaleDelayOption = 1200.0,
    window: WindowOption = 60.0,
    cold_start: Annotated[
        float | None,
        typer.Option(help="Seconds from launch to READY (default 60; 300 with --spot-trace)"),
    ] = None,
    step: StepOption = 1.0,
    plot_file: PlotOption = None,
    spot_trace: Annotated[
        str | None,
        typer.Option(
            help="Compare spot placers instead: a folder of per-zone capacity JSON files, or a "
            "shipped trace (AWS1, AWS2, AWS3, GCP1); --trace then sets the target over time"
        ),
    ] = None,
    target: Annotated[
        int, typer.Option(help="With --spot-trace and no --trace: READY replicas wanted")
    ] = 4,
    overprovision: Annotated[
        int, typer.Option(help="With --spot-trace: num_overprovision (spare spot replicas)")
    ] = 1,
    seeds: Annotated[
        int, typer.Option(help="With --spot-trace: runs of a placer with random ties, averaged")
    ] = 5,
    start: Annotated[
        float, typer.Option(help="With --spot-trace or --engine: seconds of the trace to skip")
    ] = 0.0,
    engine: EngineOption = False,
    ttft_target_ms: TtftTargetOption = 1000.0,
    percentile: PercentileOption = 90.0,
    utilization: UtilizationOption = 0.8,
    seed: SeedOption = 0,
    engine_param: EngineParamOption = None,
    engine_target: EngineTargetOption = None,
    move_waiting: MoveWaitingOption = False,
    as_json: JsonOption = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """The spelling from before the subcommands: `simulate autoscale` with --trace or
    --burst, `simulate spot` with --spot-trace. Every option of both, as they were."""
    try:
        output = json_alias(as_json, output)
    except InvalidSpec as e:
        raise fail(e) from None
    if engine:
        _simulate_engine(
            ctx,
            trace=trace,
            burst=burst,
            duration=duration,
            scale=scale,
            policies=policies,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            upscale_delay=upscale_delay,
            downscale_delay=downscale_delay,
            window=window,
            cold_start=cold_start,
            ttft_target_ms=ttft_target_ms,
            percentile=percentile,
            utilization=utilization,
            seed=seed,
            engine_param=engine_param or [],
            engine_target=engine_target or [],
            move_waiting=move_waiting,
            start=start,
            plot_file=plot_file,
            spot_trace=spot_trace,
            output=output,
        )
        return
    if move_waiting:
        raise fail(InvalidSpec("--move-waiting goes with --engine"))
    if spot_trace is not None:
        _simulate_spot(
            spot_trace=spot_trace,
            trace=trace,
            duration=duration,
            start=start,
            scale=scale,
            policies=None if policies == AUTOSCALERS else policies,
            target=target,
            target_qps=target_qps,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            cold_start=300.0 if cold_start is None else cold_start,
            overprovision=overprovision,
            seeds=seeds,
            output=output,
            plot_file=plot_file,
        )
        return
    _simulate_autoscale(
        trace=trace,
        burst=burst,
        duration=duration,
        scale=scale,
        policies=policies,
        target_qps=target_qps,
        target_inflight=target_inflight,
        latency=latency,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        upscale_delay=upscale_delay,
        downscale_delay=downscale_delay,
        window=window,
        cold_start=60.0 if cold_start is None else cold_start,
        step=step,
        plot_file=plot_file,
        output=output,
    )


def _simulate_autoscale(
    *,
    trace: str | None,
    burst: str | None,
    duration: float | None,
    scale: float,
    policies: str,
    target_qps: float,
    target_inflight: float,
    latency: float,
    min_replicas: int,
    max_replicas: int,
    upscale_delay: float,
    downscale_delay: float,
    window: float,
    cold_start: float,
    step: float,
    plot_file: Path | None,
    output: OutputFormat,
) -> None:
    from fleetserve.sim.results import SAMPLES, autoscale_simulation
    from fleetserve.sim.simulator import (
        burst_trace,
        intervals,
        load_trace,
        need_matplotlib,
        policy_for,
    )
    from fleetserve.sim.simulator import (
        simulate as run_sim,
    )

    try:
        if (trace is None) == (burst is None):
            raise InvalidSpec("give --trace FILE (or maf1) or --burst BASE:PEAK:PERIOD:LENGTH")
        if plot_file is not None:  # before the run, not after it
            check_plot_path(plot_file)
            need_matplotlib()
        if burst is not None:
            try:
                base, peak, period, length = (float(x) for x in burst.split(":"))
            except ValueError:
                raise InvalidSpec(f"--burst {burst!r}: expected BASE:PEAK:PERIOD:LENGTH") from None
            tr = burst_trace(base, peak, period, length, duration or 3600)
        else:
            assert trace is not None
            tr = load_trace(trace, scale, duration)
        runs = []
        for name in [p.strip() for p in policies.split(",") if p.strip()]:
            pol = policy_for(
                name,
                min_replicas,
                max_replicas,
                target_qps,
                target_inflight,
                upscale_delay,
                downscale_delay,
                window,
            )
            runs.append(run_sim(tr, pol, name, target_qps, latency, cold_start, step))
    except ValueError as e:
        raise fail(InvalidSpec(str(e))) from None
    if output is not OutputFormat.table:
        _plot_autoscaling(runs, tr, target_qps, plot_file, err)
        emit(
            autoscale_simulation(tr, runs, target_qps, cold_start, upscale_delay, downscale_delay),
            output,
        )
        return
    out.print(
        f"{tr.name}: {tr.seconds / 3600:.1f} h, mean {sum(tr.qps) / len(tr.qps):.2f} req/s, "
        f"peak {max(tr.qps):.2f} req/s; capacity {target_qps:g} req/s per replica, "
        f"cold start {cold_start:g} s, delays up {upscale_delay:g} s / down {downscale_delay:g} s",
        highlight=False,
    )
    table = Table(title="Policies on the same trace", title_justify="left")
    for col in ("POLICY", "REPLICA-HOURS", "OVER CAPACITY", "NO READY REPLICA", "MAX READY"):
        table.add_column(col)
    for r in runs:
        table.add_row(
            r.policy,
            f"{r.replica_hours:.1f}",
            f"{r.over_capacity_requests:,.0f} req ({100 * r.over_capacity_share:.1f}%)",
            f"{r.seconds_without_ready:,.0f} s",
            str(max(r.ready)),
        )
    out.print(table)
    rows = intervals(len(runs[0].times), SAMPLES)
    span = (rows[0][1] - rows[0][0]) * step if rows else 0.0
    samples = Table(
        title=f"Ready replicas over time, means over {_span(span)}",
        title_justify="left",
    )
    samples.add_column("FROM")
    samples.add_column("REQ/S")
    for r in runs:
        samples.add_column(r.policy.upper())
    for a, b in rows:
        samples.add_row(
            f"{runs[0].times[a] / 3600:.2f} h",
            f"{_mean(runs[0].qps[a:b]):.1f}",
            *(f"{_mean(r.ready[a:b]):.1f}" for r in runs),
        )
    out.print(samples)
    _plot_autoscaling(runs, tr, target_qps, plot_file, out)


ENGINE_IGNORES = ("target_qps", "target_inflight", "latency", "step", "target", "overprovision")


def _simulate_engine(
    ctx: typer.Context,
    *,
    trace: str | None,
    burst: str | None,
    duration: float | None,
    scale: float,
    policies: str,
    min_replicas: int,
    max_replicas: int,
    upscale_delay: float,
    downscale_delay: float,
    window: float,
    cold_start: float | None,
    ttft_target_ms: float,
    percentile: float,
    utilization: float,
    seed: int,
    engine_param: list[str],
    engine_target: list[str],
    move_waiting: bool,
    start: float,
    plot_file: Path | None,
    spot_trace: str | None,
    output: OutputFormat,
) -> None:
    from fleetserve.cli.engine_sim import parse_params, parse_targets, run_engine, show
    from fleetserve.sim.engine_sim import POLICIES
    from fleetserve.sim.results import engine_simulation

    try:
        for name in ENGINE_IGNORES:
            # typer carries its own click: its ParameterSource, compared by name.
            source = ctx.get_parameter_source(name)
            if getattr(source, "name", None) == "COMMANDLINE":
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} does not apply with --engine: the targets come from the engine "
                    "model's capacity (docs/autoscaling.md)"
                )
        if spot_trace is not None or plot_file is not None:
            raise ValueError("--engine compares autoscalers: no --spot-trace, no --plot")
        if (trace is None) == (burst is None):
            raise ValueError("give --trace FILE (or maf1) or --burst BASE:PEAK:PERIOD:LENGTH")
        if not (math.isfinite(ttft_target_ms) and 0 < ttft_target_ms <= 3_600_000):
            raise ValueError(f"--ttft-target-ms {ttft_target_ms:g}: in (0, 3600000]")
        if not 50 <= percentile <= 99.9:
            raise ValueError(f"--percentile {percentile:g}: in [50, 99.9]")
        if not 1 <= min_replicas <= max_replicas <= 100:
            raise ValueError("with --engine: 1 <= --min <= --max <= 100")
        cold = 60.0 if cold_start is None else cold_start
        if not (math.isfinite(cold) and cold >= 0):
            raise ValueError(f"--cold-start {cold:g}: seconds, >= 0")
        names = [p.strip() for p in policies.split(",") if p.strip()]
        if names == ["request_rate", "in_flight", "skyserve"]:  # the default without --engine
            names = list(POLICIES)
        names = list(dict.fromkeys(names))
        engine, workload = parse_params(engine_param)
        given = parse_targets(engine_target)
        if not (math.isfinite(start) and start >= 0):
            raise ValueError(f"--start {start:g}: seconds, >= 0")
        if burst is not None:
            tr = _burst(burst, duration)
        else:
            assert trace is not None
            from fleetserve.sim.simulator import load_trace

            tr = load_trace(trace, scale, None if duration is None else start + duration)
        tr = _skip(tr, start)
        cal, runs = run_engine(
            tr,
            names,
            engine,
            workload,
            ttft_target_ms,
            percentile,
            utilization,
            min_replicas,
            max_replicas,
            upscale_delay,
            downscale_delay,
            window,
            cold,
            seed,
            given,
            _engine_progress(tr) if err.is_terminal else None,
            move_waiting,
        )
    except ValueError as e:
        raise fail(InvalidSpec(str(e))) from None
    if output is not OutputFormat.table:
        emit(
            engine_simulation(
                tr,
                runs,
                cal,
                seed,
                percentile,
                cold,
                upscale_delay,
                downscale_delay,
                dataclasses.asdict(engine),
                dataclasses.asdict(workload),
                move_waiting,
            ),
            output,
        )
        return
    show(
        out,
        tr,
        cal,
        runs,
        engine,
        workload,
        percentile,
        cold,
        upscale_delay,
        downscale_delay,
        seed,
        move_waiting,
    )


def _skip(tr: Trace, start: float) -> Trace:
    """The trace from `start` seconds on (a held-out stretch of a long trace)."""
    if start <= 0:
        return tr
    from fleetserve.sim.simulator import Trace

    first = int(start // tr.step)
    if first >= len(tr.qps):
        raise ValueError(f"--start {start:g}: the trace lasts {tr.seconds:g} s")
    return Trace(f"{tr.name} from {start:g} s", tr.step, tr.qps[first:])


def _burst(burst: str, duration: float | None) -> Trace:
    from fleetserve.sim.simulator import burst_trace

    try:
        base, peak, period, length = (float(x) for x in burst.split(":"))
    except ValueError:
        raise ValueError(f"--burst {burst!r}: expected BASE:PEAK:PERIOD:LENGTH") from None
    return burst_trace(base, peak, period, length, duration or 3600)


def _engine_progress(tr: Trace) -> Callable[[str, int, int], None]:
    """Progress on a terminal's stderr: a day of trace takes tens of seconds."""
    began = time.monotonic()

    def progress(what: str, done: int, total: int) -> None:
        if done == 0:
            err.print(
                f"Simulating {total - 1} policies on {tr.name} ({tr.seconds / 3600:.1f} h) "
                "with the engine model...",
                highlight=False,
            )
        err.print(
            f"  [{done + 1}/{total}] {what} ({time.monotonic() - began:.0f} s so far)",
            highlight=False,
        )

    return progress


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def _plot_autoscaling(
    runs: list[Run], tr: Trace, target_qps: float, plot_file: Path | None, to: Console
) -> None:
    from fleetserve.sim.simulator import plot

    if plot_file is None:
        return
    try:
        check_plot_path(plot_file)
        plot(runs, tr, target_qps, plot_file)
    except ValueError as e:
        raise fail(InvalidSpec(str(e))) from None
    except OSError as e:
        raise fail(InvalidSpec(f"--plot {plot_file}: {e.strerror or e}")) from None
    to.print(f"Plot written to {plot_file}", highlight=False)


def json_alias(as_json: bool, output: OutputFormat) -> OutputFormat:
    """`--json` (kept for scripts) is `-o json`; with another -o it is a contradiction."""
    if not as_json:
        return output
    if output is OutputFormat.yaml:
        raise InvalidSpec("--json and -o yaml ask for two formats: give one")
    return OutputFormat.json


def check_plot_path(path: Path) -> None:
    """A plot goes to a file named with its format's suffix, in a folder that exists (matplotlib
    would add `.png` to a bare name, or write beside a folder's name)."""
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"--plot {path}: name a .png, .svg or .pdf file")
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--plot {path}: not a file in an existing folder")


def _simulate_spot(
    *,
    spot_trace: str,
    trace: str | None,
    duration: float | None,
    start: float,
    scale: float,
    policies: str | None,
    target: int,
    target_qps: float,
    min_replicas: int,
    max_replicas: int,
    cold_start: float,
    overprovision: int,
    seeds: int,
    output: OutputFormat,
    plot_file: Path | None,
) -> None:
    from fleetserve.cli.spot import plot_spot, run_spot, show
    from fleetserve.sim.results import spot_simulation
    from fleetserve.sim.simulator import load_trace, need_matplotlib
    from fleetserve.sim.spot import ALL_POLICIES, load_spot_trace

    names = (
        list(ALL_POLICIES)
        if policies is None
        else [p.strip() for p in policies.split(",") if p.strip()]
    )
    try:
        if not 1 <= target <= 100 or not 0 <= overprovision <= 100 or not 1 <= seeds <= 100:
            raise ValueError("--target 1..100, --overprovision 0..100 and --seeds 1..100")
        if not names:
            raise ValueError("--policy names no policy")
        names = list(dict.fromkeys(names))  # each once, in the order given
        if not (math.isfinite(cold_start) and cold_start >= 0):
            raise ValueError(f"--cold-start {cold_start}: seconds, >= 0")
        if trace is not None and not (target_qps > 0 and 1 <= min_replicas <= max_replicas <= 100):
            raise ValueError("with --trace: --target-qps > 0 and 1 <= --min <= --max <= 100")
        if plot_file is not None:  # before the run (tens of seconds), not after it
            check_plot_path(plot_file)
            need_matplotlib()
        st = load_spot_trace(spot_trace, duration, start)
        requests = None
        if trace is not None:
            requests = load_trace(trace, scale, st.seconds)
        results = run_spot(
            st,
            names,
            target,
            requests,
            target_qps,
            min_replicas,
            max_replicas,
            cold_start,
            overprovision,
            seeds,
            _spot_progress(st.name, st.seconds) if err.is_terminal else None,
        )
        if plot_file is not None:
            try:
                plot_spot(st, results, plot_file)
            except OSError as e:
                raise ValueError(f"--plot {plot_file}: {e.strerror or e}") from None
    except ValueError as e:
        raise fail(InvalidSpec(str(e))) from None
    if output is not OutputFormat.table:
        emit(spot_simulation(st, results), output)
    else:
        show(out, st, results, False)
    if plot_file is not None:
        (out if output is OutputFormat.table else err).print(f"Plot written to {plot_file}")


def _spot_progress(trace: str, seconds: float) -> Callable[[str, int, int], None]:
    """Progress on a terminal's stderr: a long trace takes tens of seconds (AWS3: ~25 s)."""
    began = time.monotonic()

    def progress(what: str, done: int, total: int) -> None:
        if done == 0:
            err.print(
                f"Simulating {total} runs on {trace} ({seconds / 86400:.1f} days)...",
                highlight=False,
            )
        err.print(
            f"  [{done + 1}/{total}] {what} ({time.monotonic() - began:.0f} s so far)",
            highlight=False,
        )

    return progress
