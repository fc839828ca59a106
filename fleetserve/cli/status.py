"""`fleetserve status` and `fleetserve events`: what the services are and did."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from fleetserve.api.models import EventInfo, ServiceInfo
from fleetserve.cli.common import ServiceArg, err, fail, out
from fleetserve.cli.completion import complete_service
from fleetserve.cli.output import (
    OutputFormat,
    OutputOption,
    check_interval,
    emit,
    quiet_broken_pipe,
    stream_item,
    to_data,
    write,
)
from fleetserve.cli.render import event_line, events_table, replicas_table, services_table
from fleetserve.cli.safe import safe
from fleetserve.client import Client
from fleetserve.core.errors import FleetserveError, InvalidSpec, NotFound, TransientError
from fleetserve.core.text import visible


def status(
    name: Annotated[
        str | None,
        typer.Argument(help="One service (default: all).", autocompletion=complete_service),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Add recent events.")] = False,
    endpoint: Annotated[bool, typer.Option("--endpoint", help="Print the endpoint only.")] = False,
    output: OutputOption = OutputFormat.table,
    watch: Annotated[
        bool, typer.Option("-w", "--watch", help="Refresh the tables in place until Ctrl-C.")
    ] = False,
    interval: Annotated[
        float | None,
        typer.Option(
            help="With --watch: seconds between refreshes (0.5..3600; default 2).",
            callback=check_interval,
        ),
    ] = None,
) -> None:
    """Services and their replicas, with failure reasons. `-o json` prints the REST API's body
    (GET /services, or /services/NAME with a NAME)."""
    try:
        if output is not OutputFormat.table:
            if watch:
                raise InvalidSpec(
                    f"-w/--watch refreshes a table: it takes no -o {output.value} "
                    f"(run `fleetserve status -o {output.value}` in a loop instead)"
                )
            if verbose:
                raise InvalidSpec(
                    f"-v adds an events table: with -o {output.value} use "
                    f"`fleetserve events NAME -o {output.value}`"
                )
            if endpoint:
                raise InvalidSpec(f"--endpoint prints the endpoint alone: no -o {output.value}")
        if interval is not None and not watch:
            raise InvalidSpec("--interval goes with -w/--watch")
        if watch and endpoint:
            raise InvalidSpec("--endpoint prints the endpoint once: no -w/--watch")
        client = Client()
        if output is not OutputFormat.table:
            emit(client.service(name) if name is not None else client.status(), output)
            return
        if watch:
            _watch_status(client, name, verbose, 2.0 if interval is None else interval)
            return
        services = client.status(name)
        if endpoint:
            if name is None:
                raise InvalidSpec("--endpoint needs a service name")
            if not services[0].endpoint:
                raise FleetserveError(f"service {name} has no endpoint yet ({services[0].status})")
            print(services[0].endpoint)
            return
        for part in _status_view(client, services, verbose):
            # A reason's line is never wrapped by rich (its `command` stays whole); tables are.
            out.print(part, highlight=False, soft_wrap=isinstance(part, Text))
    except FleetserveError as e:
        raise fail(e) from None


def _status_view(
    client: Client, services: list[ServiceInfo], verbose: bool
) -> list[RenderableType]:
    """What `fleetserve status` shows: the services, their problems, the replicas, and with
    `verbose` each service's recent events."""
    note = _token_scan_note(client)
    if not services:
        return ["No services. Start one with `fleetserve up service.yaml`.", *note]
    parts: list[RenderableType] = [services_table(services)]
    for s in services:
        if s.failure_reason:
            parts.append(Text.from_markup(f"[red]{safe(s.name)}:[/] {safe(s.failure_reason)}"))
            if s.serving_version and s.serving_version != s.active_version:
                parts.append(
                    Text(
                        f"{s.name}: version {s.active_version} failed; version "
                        f"{s.serving_version} keeps serving. `fleetserve rollback {s.name}` "
                        f"drops version {s.active_version}."
                    )
                )
        if s.spot_placer:
            placer, summary = s.spot_placer.get("placer"), s.spot_placer.get("summary")
            parts.append(Text(f"{s.name}: spot placer {placer}; {summary}"))
    parts.append(replicas_table(services))
    parts += note
    if verbose:
        parts += [events_table(s.name, client.events(s.name, 30)) for s in services]
    return parts


def _token_scan_note(client: Client) -> list[RenderableType]:
    """A line when the controller cannot put local replicas and jobs in cgroups (what escapes
    their stop then: docs/security.md); nothing when it can."""
    with contextlib.suppress(FleetserveError):
        processes = client.health().processes
        if processes and processes.startswith("token scan"):
            return [Text(f"Local replicas and jobs: stopped by {processes}", style="yellow")]
    return []


def _watch_status(client: Client, name: str | None, verbose: bool, interval: float) -> None:
    """Redraw the status every `interval` seconds until Ctrl-C (on a terminal, in place; else
    one view after another). An unreachable controller is shown and retried."""
    from rich.live import Live

    command = "fleetserve status" + (f" {name}" if name else "")

    def view() -> Group:
        head = Text(
            f"Every {interval:g} s: {command}   {time.strftime('%H:%M:%S')}   (Ctrl-C stops)",
            style="dim",
        )
        try:
            parts = _status_view(client, client.status(name), verbose)
        except TransientError as e:
            parts = [Text(f"{visible(e.message)} (retrying)", style="red")]
        return Group(head, *parts)

    try:
        if not out.is_terminal:
            while True:
                out.print(view(), highlight=False)
                time.sleep(interval)
        with Live(view(), console=out, auto_refresh=False, redirect_stderr=False) as live:
            while True:
                time.sleep(interval)
                live.update(view(), refresh=True)
    except KeyboardInterrupt:
        return
    except BrokenPipeError:
        quiet_broken_pipe()


def events(
    name: ServiceArg,
    follow: Annotated[
        bool,
        typer.Option(
            "-f", "--follow", help="Keep printing new events as they come (Ctrl-C stops)."
        ),
    ] = False,
    limit: Annotated[
        int, typer.Option("-n", "--limit", min=1, max=1000, help="The newest N events (1..1000).")
    ] = 50,
    output: OutputOption = OutputFormat.table,
) -> None:
    """A service's events, oldest first: replica status changes, launches, failures, scaling,
    updates. `-o json` prints the REST API's body (GET /services/NAME/events); with -f, one JSON
    object per line (JSON Lines)."""
    try:
        client = Client()
        backlog = client.events(name, limit)
        if follow:
            _follow_events(client, name, backlog, output)
        elif output is not OutputFormat.table:
            emit(backlog, output)
        elif not backlog:
            out.print(f"No events for {name}.", highlight=False)
        else:
            out.print(events_table(name, backlog, kinds=True), highlight=False)
    except KeyboardInterrupt:
        return
    except BrokenPipeError:  # `fleetserve events NAME -f -o json | head`
        quiet_broken_pipe()
        return
    except FleetserveError as e:
        raise fail(e) from None


FOLLOW_POLL = 1.0  # seconds between polls of `fleetserve events -f`
FOLLOW_BATCH = 1000  # events per poll (the API's most)


def _follow_events(
    client: Client, name: str, backlog: list[EventInfo], output: OutputFormat
) -> None:
    """Print `backlog`, then each new event once (polling with the last event_id seen) until
    Ctrl-C; a deleted service ends it with exit 1."""
    if any(e.event_id <= 0 for e in backlog):
        raise FleetserveError(
            "this controller gives no event ids (it is older than this CLI): -f/--follow needs "
            "a controller of the same version"
        )

    def show(e: EventInfo) -> None:
        if output is OutputFormat.table:
            out.print(event_line(e), highlight=False, soft_wrap=True)
        else:
            write(stream_item(to_data(e), output))

    for e in backlog:
        show(e)
    last = backlog[-1].event_id if backlog else 0
    if output is OutputFormat.table:
        err.print(f"(following {name}'s events; Ctrl-C stops)", highlight=False)
    unreachable = False
    while True:
        time.sleep(FOLLOW_POLL)
        while True:
            try:
                new = client.events(name, FOLLOW_BATCH, after=last)
            except NotFound:
                err.print(f"Service {name} was deleted: no more events.", highlight=False)
                raise typer.Exit(1) from None
            except TransientError as down:
                if not unreachable:
                    err.print(
                        f"[yellow]warning:[/] {safe(down.message)} (retrying)", highlight=False
                    )
                unreachable = True
                break
            unreachable = False
            for e in new:
                show(e)
                last = max(last, e.event_id)
            if len(new) < FOLLOW_BATCH:
                break
