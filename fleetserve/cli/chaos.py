"""`fleetserve chaos`: inject preemptions and replay spot-capacity traces on the local infra's
zones (docs/spot.md)."""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from fleetserve.api.models import Preempted
from fleetserve.cli.safe import safe
from fleetserve.client import Client
from fleetserve.core.errors import FleetserveError, InvalidSpec

chaos_app = typer.Typer(
    help="Inject faults on the local infra: preemptions, spot capacity over time.",
    no_args_is_help=True,
)
out = Console(highlight=False)

MAX_SPEED = 1_000_000.0
MIN_STEP_SECONDS = 0.05  # wall seconds between two capacity changes, at most this often
MAX_REPLAY_STEPS = 100_000


def _fail(e: FleetserveError) -> typer.Exit:
    Console(stderr=True, highlight=False).print(f"[red]Error:[/] {safe(e.message)}")
    return typer.Exit(e.exit_code)


def _lost(preempted: list[Preempted]) -> str:
    return ", ".join(f"{p.service}/{p.replica_id} ({p.zone})" for p in preempted)


@chaos_app.command("preempt")
def preempt(
    service: Annotated[str, typer.Argument(help="Service.")],
    replica: Annotated[int | None, typer.Option("--replica", help="One replica's id.")] = None,
    zone: Annotated[
        str | None, typer.Option("--zone", help="Every spot replica of the service there.")
    ] = None,
) -> None:
    """Preempt a replica (or a zone's spot replicas) at once: no SIGTERM, no drain."""
    try:
        if (replica is None) == (zone is None):
            raise InvalidSpec("name --replica ID or --zone Z (one of them)")
        lost = Client().chaos_preempt(service, replica, zone)
    except FleetserveError as e:
        raise _fail(e) from None
    out.print(f"Preempted: {_lost(lost)}" if lost else f"No spot replica of {service} in {zone}.")


@chaos_app.command("capacity")
def capacity(
    zone: Annotated[str, typer.Argument(help="Zone.")],
    spot: Annotated[str, typer.Argument(help="Spot capacity: a whole number, or 'unlimited'.")],
) -> None:
    """Set a zone's spot capacity; a zone below what it holds preempts its newest spot
    replicas, a full zone refuses spot launches."""
    try:
        n = _capacity_arg(spot)
        lost = Client().chaos_capacity({zone: n})
    except FleetserveError as e:
        raise _fail(e) from None
    tail = f" Preempted: {_lost(lost)}" if lost else ""
    out.print(f"Zone {zone}: spot capacity {spot}.{tail}")


def _capacity_arg(raw: str) -> int | None:
    if raw == "unlimited":
        return None
    try:
        n = int(raw)
    except ValueError:
        raise InvalidSpec(f"capacity {raw!r}: a whole number >= 0, or 'unlimited'") from None
    if n < 0:
        raise InvalidSpec(f"capacity {n}: a whole number >= 0, or 'unlimited'")
    return n


@chaos_app.command("zones")
def zones() -> None:
    """The local infra's zones: spot capacity now, what is held, prices."""
    try:
        rows = Client().zones()
    except FleetserveError as e:
        raise _fail(e) from None
    for z in rows:
        cap = z.get("spot_capacity")
        out.print(
            f"{z['zone']}: spot {z.get('spot_held', '-')}/{'unlimited' if cap is None else cap}"
            f", on-demand {z.get('on_demand_held', '-')}"
        )


@chaos_app.command("replay")
def replay(
    trace: Annotated[
        str, typer.Argument(help="A spot trace: a folder of per-zone JSON files, or AWS1-3, GCP1.")
    ],
    speed: Annotated[float, typer.Option(help="Trace seconds per wall second.")] = 60.0,
    start: Annotated[float, typer.Option(help="Trace seconds to skip.")] = 0.0,
    duration: Annotated[
        float | None, typer.Option(help="Trace seconds to replay (default: all).")
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave the last capacity in place at the end.")
    ] = False,
) -> None:
    """Replay a trace's spot capacity over the local zones in compressed time: its zones map
    onto the local ones in order; a zone at 0 preempts its spot replicas and fails launches.
    At the end (or on Ctrl-C) each zone's declared capacity comes back, unless --keep."""
    from fleetserve.sim.spot import load_spot_trace

    try:
        if not math.isfinite(speed) or not 0 < speed <= MAX_SPEED:
            raise InvalidSpec(
                f"--speed {speed}: trace seconds per wall second, in (0, {MAX_SPEED:g}]"
            )
        try:
            st = load_spot_trace(trace, duration, start)
        except ValueError as e:
            raise InvalidSpec(str(e)) from None
        client = Client()
        local = [str(z["zone"]) for z in client.zones()]
        mapping = dict(zip(st.zones, local, strict=False))
        steps = int(st.seconds // st.step)
        too_big = max((max(v) for v in st.capacity.values()), default=0)
        if too_big > 10_000:
            raise InvalidSpec(f"{trace}: a capacity of {too_big} (a zone holds at most 10000)")
        if steps > MAX_REPLAY_STEPS:
            raise InvalidSpec(
                f"{steps} steps to replay, at most {MAX_REPLAY_STEPS}: cut it with --duration"
            )
        wall_step = st.step / speed
        if wall_step < MIN_STEP_SECONDS:
            raise InvalidSpec(
                f"--speed {speed:g} makes a {st.step:g} s step last {wall_step:.3f} s of wall "
                f"time; at most {st.step / MIN_STEP_SECONDS:g} for this trace"
            )
        out.print(
            f"Replaying {st.name}: {steps} steps of {st.step:g} s at {speed:g}x "
            f"({steps * wall_step:.0f} s); zones: "
            + ", ".join(f"{t} -> {lz}" for t, lz in mapping.items())
        )
        _run_replay(client, st, mapping, steps, wall_step, keep)
    except FleetserveError as e:
        raise _fail(e) from None


def _run_replay(
    client: Client, st: Any, mapping: dict[str, str], steps: int, wall_step: float, keep: bool
) -> None:
    declared = {str(z["zone"]): z.get("declared_spot_capacity") for z in client.zones()}
    began = time.monotonic()
    total = 0
    last: dict[str, int | None] = {}
    try:
        for i in range(steps):
            t = i * st.step
            cap: dict[str, int | None] = {lz: st.at(tz, t) for tz, lz in mapping.items()}
            # Every step, not only changes: a controller restarted meanwhile starts from the
            # declared capacities and gets the trace's again at the next step.
            lost = client.chaos_capacity(cap)
            total += len(lost)
            if cap != last or lost:
                shown = " ".join(f"{z}={n}" for z, n in cap.items())
                line = f"[{i + 1}/{steps}] t={t:>8.0f}s {shown}"
                out.print(line + (f"; preempted {_lost(lost)}" if lost else ""))
            last = cap
            delay = began + (i + 1) * wall_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        if not keep:
            client.chaos_capacity({z: declared.get(z) for z in mapping.values()})
    out.print(f"Replayed {steps} steps; {total} replicas preempted.")
