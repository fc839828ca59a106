"""`fleetserve`: up, status, logs, down, validate and server management."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fleetserve.api.models import EventInfo, ServiceInfo
from fleetserve.cli.chaos import chaos_app
from fleetserve.cli.completion import complete_service
from fleetserve.cli.dashboard import dashboard
from fleetserve.cli.envs import overrides
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
from fleetserve.cli.pools import jobs_app, pool_app
from fleetserve.cli.render import (
    event_line,
    events_table,
    replicas_table,
    services_table,
    styled,
)
from fleetserve.client import BUSY_WAIT_SECONDS, Client, server_pid, start_server, stop_server
from fleetserve.controller.admission import has_container_runtime
from fleetserve.controller.settings import Settings, is_loopback
from fleetserve.core.errors import FleetserveError, InvalidSpec, NotFound, TransientError
from fleetserve.spec.compat import compat_errors, compat_warnings
from fleetserve.spec.exposure import exposure_warning, override_host
from fleetserve.spec.loader import load_spec_file, missing_secrets, require_values

if TYPE_CHECKING:
    from fleetserve.sim.simulator import Run, Trace

app = typer.Typer(
    help="Serve any model server as a fleet of replicas behind one endpoint.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (docs/output.md)
    pretty_exceptions_enable=False,
)
server_app = typer.Typer(help="Manage the background controller.", no_args_is_help=True)
app.add_typer(server_app, name="server")
app.add_typer(chaos_app, name="chaos")
app.add_typer(pool_app, name="pool")
app.add_typer(jobs_app, name="jobs")
app.command("dashboard")(dashboard)
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def _fail(e: FleetserveError) -> typer.Exit:
    err.print(f"[red]Error:[/] {e.message}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(e.exit_code)


EnvOption = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="KEY=VALUE over the YAML's envs (repeatable); KEY alone takes your shell's value",
    ),
]
EnvFileOption = Annotated[
    Path | None,
    typer.Option("--env-file", help="A dotenv file of KEY=VALUE lines (--env wins over it)"),
]
SecretOption = Annotated[
    list[str] | None,
    typer.Option(
        "--secret",
        help="KEY=VALUE over the YAML's secrets (repeatable); KEY alone takes your shell's "
        "value. Never shown back",
    ),
]

ServiceArg = Annotated[str, typer.Argument(help="Service.", autocompletion=complete_service)]


def _overrides(
    env: list[str] | None, env_file: Path | None, secret: list[str] | None
) -> tuple[dict[str, str], dict[str, str]]:
    return overrides(env, env_file, secret, os.environ)


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="Service YAML to check.")],
    env: EnvOption = None,
    env_file: EnvFileOption = None,
    secret: SecretOption = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict", help="Also exit 2 when the file is valid but cannot run on this machine."
        ),
    ] = False,
) -> None:
    """Check a service YAML (with the --env / --secret values `up` would get) as SkyPilot's
    parser does: print what is wrong, exit 2 if anything is. What is valid but cannot run here
    (multi-node, pools, container images, SkyPilot volumes) is printed as `cannot run here:`
    lines; --strict makes those exit 2 as well."""
    try:
        envs, secrets = _overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        try:
            require_values(spec, secrets_too=False)  # SkyPilot's parser takes a null secret
        except InvalidSpec as e:
            raise InvalidSpec(f"{file}: {e.message}") from None
    except InvalidSpec as e:
        raise _fail(e) from None
    not_here = compat_errors(spec, has_container_runtime())
    _print_warnings(compat_warnings(spec, spec.requested_infra() or "local"))
    _print_warnings(
        [
            f"secrets.{k}: null here; `up` needs it: --secret {k}[=VALUE]"
            for k in missing_secrets(spec)
        ]
    )
    for line in not_here:
        out.print(f"[red]cannot run here:[/] {escape(line)}", highlight=False)
    pool = spec.service.pool
    if pool is not None:
        size = (
            pool.workers if pool.workers is not None else f"{pool.min_workers}..{pool.max_workers}"
        )
        summary = f"a worker pool of {size} workers"
    else:
        lo, hi = spec.service.replica_bounds()
        probe = spec.service.readiness_probe
        probe_text = f"{probe.method} {probe.path}" if probe else "-"
        summary = (
            f"replicas {lo}..{hi}, probe {probe_text}, policy {spec.service.load_balancing_policy}"
        )
    if not_here:
        out.print(
            f"[green]OK[/] {escape(str(file))}: valid ({summary}), but `fleetserve up` refuses it "
            "here (cannot run here: above)",
            highlight=False,
            soft_wrap=True,
        )
        if strict:
            raise typer.Exit(2)
        return
    out.print(f"[green]OK[/] {escape(str(file))}: {summary}", highlight=False, soft_wrap=True)


def _print_warnings(lines: list[str]) -> None:
    for line in lines:
        out.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)


def _print_changes(svc: ServiceInfo, seen: dict[int, str], versions: bool = False) -> None:
    """One line per replica whose status changed since the last call."""
    for r in svc.replicas:
        if seen.get(r.replica_id) != r.status:
            seen[r.replica_id] = r.status
            extra = f" - {r.reason}" if r.reason else ""
            which = f"{r.replica_id} (v{r.version})" if versions else str(r.replica_id)
            out.print(f"  replica {which}: {styled(r.status)}{extra}", highlight=False)


def _last_setup_line(client: Client, svc: ServiceInfo, shown: dict[int, str]) -> None:
    """While a replica runs its setup, show its newest log line (when it changes)."""
    for r in svc.replicas:
        if r.status != "PROVISIONING":
            continue
        try:
            lines = list(client.replica_logs(svc.name, r.replica_id, tail=1))
        except FleetserveError:
            return
        line = lines[-1].strip()[:160] if lines else ""
        if line and shown.get(r.replica_id) != line:
            shown[r.replica_id] = line
            text = f"    [dim]replica {r.replica_id}:[/] {escape(line)}"
            out.print(text, highlight=False, markup=True)
        return  # one replica's setup is enough to show progress


def _follow_up(client: Client, name: str) -> ServiceInfo:
    """Print replica status changes until one is READY or the service fails; while setup
    runs, its newest log line."""
    seen: dict[int, str] = {}
    shown: dict[int, str] = {}
    out.print(
        "  (Ctrl-C stops watching; the service keeps launching. `fleetserve up -d` returns "
        "at once.)",
        highlight=False,
    )
    last_tail = 0.0
    while True:
        svc = client.service(name)
        _print_changes(svc, seen)
        if time.monotonic() - last_tail >= 2.0:
            last_tail = time.monotonic()
            _last_setup_line(client, svc, shown)
        if svc.status == "READY":
            return svc
        if svc.min_replicas == 0 and svc.endpoint and not svc.replicas:
            out.print("  scaled to zero: the first request starts a replica (and waits for it)")
            return svc
        if svc.status in ("FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP"):
            why = svc.failure_reason or "see `fleetserve status -v`"
            raise FleetserveError(f"service {name} is {svc.status}: {why}")
        time.sleep(0.5)


@app.command()
def up(
    file: Annotated[Path, typer.Argument(help="Service YAML (SkyServe format).")],
    name: Annotated[str | None, typer.Option("-n", "--name", help="Service name.")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once accepted.")] = False,
    infra: Annotated[
        str | None, typer.Option(help="local (default) or ray: where the replicas run")
    ] = None,
    env: EnvOption = None,
    env_file: EnvFileOption = None,
    secret: SecretOption = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="The address the endpoint binds (service.load_balancer.host); default "
            "127.0.0.1 on the local infra, 0.0.0.0 on ray"
        ),
    ] = None,
) -> None:
    """Start a service: its replicas and a load balancer; print the endpoint."""
    try:
        envs, secrets = _overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)  # a clear local error before anything
        require_values(spec)
        if host is not None:
            spec = override_host(spec, host)
        warning = exposure_warning(spec, infra or "local")
        if warning is not None:
            err.print(warning, highlight=False)
        client = Client()
        svc = client.up_file(file, name, infra, envs, secrets, host)
        _print_warnings(svc.warnings)
        out.print(f"Service [bold]{svc.name}[/] accepted; launching {svc.min_replicas} replica(s).")
        if detach:
            out.print(f"Check it with `fleetserve status {svc.name}`.")
            return
        try:
            svc = _follow_up(client, svc.name)
        except KeyboardInterrupt:
            out.print(f"\nStopped watching; {svc.name} keeps launching (`fleetserve status`).")
            return
    except FleetserveError as e:
        raise _fail(e) from None
    out.print(f"Service [bold]{svc.name}[/] is {svc.status}.")
    out.print(f"Endpoint: {svc.endpoint}", highlight=False)


def _follow_rollout(client: Client, name: str, version: int) -> ServiceInfo:
    """Print replica changes until `version` serves (or, for a canary, has a READY replica),
    or the rollout fails."""
    seen: dict[int, str] = {}
    while True:
        svc = client.service(name)
        _print_changes(svc, seen, versions=True)
        if svc.active_version != version:
            raise FleetserveError(f"the rollout of version {version} was abandoned (rollback)")
        if svc.failure_reason:
            raise FleetserveError(
                f"version {version} failed; version {svc.serving_version} keeps serving. "
                f"{svc.failure_reason}"
            )
        if svc.serving_version == version:
            return svc
        if svc.traffic_percent is not None and any(
            r.version == version and r.status == "READY" for r in svc.replicas
        ):
            return svc
        time.sleep(0.5)


@app.command()
def update(
    name: Annotated[
        str, typer.Argument(help="Service to update.", autocompletion=complete_service)
    ],
    file: Annotated[Path, typer.Argument(help="The new service YAML.")],
    mode: Annotated[str, typer.Option(help="rolling or blue_green")] = "rolling",
    traffic_percent: Annotated[
        int | None, typer.Option(help="A canary: send this % of requests to the new version")
    ] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once accepted.")] = False,
    env: EnvOption = None,
    env_file: EnvFileOption = None,
    secret: SecretOption = None,
) -> None:
    """Roll out a new version with no failed request (rolling, blue-green or canary)."""
    try:
        envs, secrets = _overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        require_values(spec)
        client = Client()
        svc = client.update_file(name, file, mode, traffic_percent, envs, secrets)
        _print_warnings(svc.warnings)
        version = svc.active_version
        if svc.serving_version == version:
            out.print(f"Version {version} serves: the replicas moved to it in place.")
            return
        out.print(f"Rolling out version {version} of {name} ({svc.update_mode}).")
        if detach:
            return
        svc = _follow_rollout(client, name, version)
    except FleetserveError as e:
        raise _fail(e) from None
    if svc.traffic_percent is not None and svc.serving_version != version:
        out.print(
            f"Canary version {version} takes {svc.traffic_percent}% of requests; "
            f"`fleetserve promote {name}` to roll it out, `fleetserve rollback {name}` to drop it."
        )
    else:
        out.print(
            f"Version {version} serves. `fleetserve rollback {name}` returns to the last one."
        )


@app.command()
def rollback(name: ServiceArg) -> None:
    """Return to the version that served before (abandons a rollout in progress)."""
    try:
        svc = Client().rollback(name)
    except FleetserveError as e:
        raise _fail(e) from None
    out.print(f"{name}: rolling back to version {svc.active_version}.")


@app.command()
def promote(name: ServiceArg) -> None:
    """Roll a canary out to the whole fleet."""
    try:
        svc = Client().promote(name)
    except FleetserveError as e:
        raise _fail(e) from None
    out.print(f"{name}: promoting version {svc.active_version} to the whole fleet.")


@app.command()
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
            out.print(part, highlight=False)
    except FleetserveError as e:
        raise _fail(e) from None


def _status_view(
    client: Client, services: list[ServiceInfo], verbose: bool
) -> list[RenderableType]:
    """What `fleetserve status` shows: the services, their problems, the replicas, and with
    `verbose` each service's recent events."""
    if not services:
        return ["No services. Start one with `fleetserve up service.yaml`."]
    parts: list[RenderableType] = [services_table(services)]
    for s in services:
        if s.failure_reason:
            parts.append(Text.from_markup(f"[red]{escape(s.name)}:[/] {escape(s.failure_reason)}"))
        if s.spot_placer:
            placer, summary = s.spot_placer.get("placer"), s.spot_placer.get("summary")
            parts.append(Text(f"{s.name}: spot placer {placer}; {summary}"))
    parts.append(replicas_table(services))
    if verbose:
        parts += [events_table(s.name, client.events(s.name, 30)) for s in services]
    return parts


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
            parts = [Text(f"{e.message} (retrying)", style="red")]
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


@app.command()
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
        raise _fail(e) from None


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
                    err.print(f"[yellow]warning:[/] {down.message} (retrying)", highlight=False)
                unreachable = True
                break
            unreachable = False
            for e in new:
                show(e)
                last = max(last, e.event_id)
            if len(new) < FOLLOW_BATCH:
                break


@app.command()
def logs(
    name: Annotated[
        str | None, typer.Argument(help="Service name.", autocompletion=complete_service)
    ] = None,
    replica_id: Annotated[int | None, typer.Argument(help="Replica id.")] = None,
    controller: Annotated[bool, typer.Option("--controller", help="The controller's log.")] = False,
    load_balancer: Annotated[
        bool, typer.Option("--load-balancer", help="The service's load-balancer log.")
    ] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing.")] = False,
) -> None:
    """Print a replica's output (setup and run), or the controller's or load balancer's log."""
    try:
        client = Client()
        if controller:
            lines = client.component_logs("controller", follow=follow)
        elif load_balancer:
            if name is None:
                raise InvalidSpec("--load-balancer needs a service name")
            lines = client.component_logs("load-balancer", name, follow)
        else:
            if name is None or replica_id is None:
                raise InvalidSpec(
                    "give NAME and REPLICA_ID, or --controller, or NAME --load-balancer"
                )
            lines = client.replica_logs(name, replica_id, follow)
        for line in lines:
            print(line, flush=True)
    except KeyboardInterrupt:
        return
    except FleetserveError as e:
        raise _fail(e) from None


@app.command()
def down(
    names: Annotated[
        list[str] | None,
        typer.Argument(help="Services to take down.", autocompletion=complete_service),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Every service.")] = False,
    purge: Annotated[
        bool, typer.Option("--purge", help="Remove rows even if some teardown failed.")
    ] = False,
    replica_id: Annotated[
        int | None, typer.Option("--replica-id", help="Terminate one replica (it is replaced).")
    ] = None,
) -> None:
    """Stop services (replicas, load balancer) and remove them; or terminate one replica."""
    try:
        client = Client()
        if replica_id is not None:
            if not names or len(names) != 1:
                raise InvalidSpec("--replica-id needs exactly one service name")
            client.terminate_replica(names[0], replica_id, purge)
            out.print(f"Terminating replica {replica_id} of {names[0]}.")
            return
        if all_:
            names = [s.name for s in client.status()]
            if not names:
                out.print("No services to take down.")
                return
        if not names:
            raise InvalidSpec("name the services to take down, or use --all")
        for n in names:
            client.down(n, purge)
        failed = False
        for n in names:
            out.print(f"Taking down {n}...")
            left = client.wait_gone(n)
            if left is None:
                out.print(f"Service [bold]{n}[/] is down.")
            else:
                failed = True
                err.print(f"[red]{n}:[/] {left.failure_reason or left.status}", highlight=False)
        if failed:
            raise typer.Exit(1)
    except FleetserveError as e:
        raise _fail(e) from None


@app.command()
def simulate(
    trace: Annotated[
        str | None, typer.Option(help="CSV of time_s,qps (or 'Time (min),Requests'); maf1: MAF")
    ] = None,
    burst: Annotated[
        str | None, typer.Option(help="Generated: BASE:PEAK:PERIOD:LENGTH (req/s, seconds)")
    ] = None,
    duration: Annotated[float | None, typer.Option(help="Seconds of the trace to replay")] = None,
    scale: Annotated[float, typer.Option(help="Multiply the trace's rates")] = 1.0,
    policies: Annotated[
        str, typer.Option("--policy", help="Comma-separated: request_rate,in_flight,skyserve")
    ] = "request_rate,in_flight,skyserve",
    target_qps: Annotated[float, typer.Option(help="Requests/s per replica (its capacity)")] = 5.0,
    target_inflight: Annotated[float, typer.Option(help="For in_flight")] = 5.0,
    latency: Annotated[
        float, typer.Option(help="Seconds per request (in flight = rate x this)")
    ] = 1.0,
    min_replicas: Annotated[int, typer.Option("--min")] = 1,
    max_replicas: Annotated[int, typer.Option("--max")] = 10,
    upscale_delay: Annotated[float, typer.Option(help="Seconds")] = 300.0,
    downscale_delay: Annotated[float, typer.Option(help="Seconds")] = 1200.0,
    window: Annotated[float, typer.Option(help="Request-rate window, seconds")] = 60.0,
    cold_start: Annotated[
        float | None,
        typer.Option(help="Seconds from launch to READY (default 60; 300 with --spot-trace)"),
    ] = None,
    step: Annotated[float, typer.Option(help="Seconds between decisions")] = 1.0,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="Write a PNG here")] = None,
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
    start: Annotated[float, typer.Option(help="With --spot-trace: seconds to skip")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="The same as -o json")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Replay a request trace through autoscaling policies on a virtual clock and compare them:
    replicas over time, requests over capacity, replica-hours. With --spot-trace, compare spot
    placers on a spot-capacity trace instead: cost, availability, preemptions. `-o json|yaml`
    prints the result as data (docs/output.md)."""
    try:
        output = json_alias(as_json, output)
    except InvalidSpec as e:
        raise _fail(e) from None
    if spot_trace is not None:
        _simulate_spot(
            spot_trace,
            trace,
            duration,
            start,
            scale,
            policies,
            target,
            target_qps,
            min_replicas,
            max_replicas,
            cold_start,
            overprovision,
            seeds,
            output,
            plot_file,
        )
        return
    cold_start = 60.0 if cold_start is None else cold_start
    from fleetserve.sim.results import autoscale_simulation
    from fleetserve.sim.simulator import (
        burst_trace,
        load_trace,
        policy_for,
    )
    from fleetserve.sim.simulator import (
        simulate as run_sim,
    )

    try:
        if (trace is None) == (burst is None):
            raise InvalidSpec("give --trace FILE (or maf1) or --burst BASE:PEAK:PERIOD:LENGTH")
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
        raise _fail(InvalidSpec(str(e))) from None
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
    samples = Table(title="Ready replicas over time", title_justify="left")
    samples.add_column("TIME")
    samples.add_column("REQ/S")
    for r in runs:
        samples.add_column(r.policy.upper())
    n = len(runs[0].times)
    for i in range(0, n, max(1, n // 12)):
        samples.add_row(
            f"{runs[0].times[i] / 3600:.2f} h",
            f"{runs[0].qps[i]:.1f}",
            *(str(r.ready[i]) for r in runs),
        )
    out.print(samples)
    _plot_autoscaling(runs, tr, target_qps, plot_file, out)


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
        raise _fail(InvalidSpec(str(e))) from None
    except OSError as e:
        raise _fail(InvalidSpec(f"--plot {plot_file}: {e.strerror or e}")) from None
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
    spot_trace: str,
    trace: str | None,
    duration: float | None,
    start: float,
    scale: float,
    policies: str,
    target: int,
    target_qps: float,
    min_replicas: int,
    max_replicas: int,
    cold_start: float | None,
    overprovision: int,
    seeds: int,
    output: OutputFormat,
    plot_file: Path | None,
) -> None:
    from fleetserve.cli.spot import plot_spot, run_spot, show
    from fleetserve.sim.results import spot_simulation
    from fleetserve.sim.simulator import load_trace
    from fleetserve.sim.spot import ALL_POLICIES, load_spot_trace

    names = [p.strip() for p in policies.split(",") if p.strip()]
    if names == ["request_rate", "in_flight", "skyserve"]:  # the autoscaling default
        names = list(ALL_POLICIES)
    try:
        if not 1 <= target <= 100 or not 0 <= overprovision <= 100 or not 1 <= seeds <= 100:
            raise ValueError("--target 1..100, --overprovision 0..100 and --seeds 1..100")
        if not names:
            raise ValueError("--policy names no policy")
        names = list(dict.fromkeys(names))  # each once, in the order given
        if cold_start is not None and not (math.isfinite(cold_start) and cold_start >= 0):
            raise ValueError(f"--cold-start {cold_start}: seconds, >= 0")
        if trace is not None and not (target_qps > 0 and 1 <= min_replicas <= max_replicas <= 100):
            raise ValueError("with --trace: --target-qps > 0 and 1 <= --min <= --max <= 100")
        if plot_file is not None:
            check_plot_path(plot_file)
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
            300.0 if cold_start is None else cold_start,
            overprovision,
            seeds,
        )
        if plot_file is not None:
            try:
                plot_spot(st, results, plot_file)
            except OSError as e:
                raise ValueError(f"--plot {plot_file}: {e.strerror or e}") from None
    except ValueError as e:
        raise _fail(InvalidSpec(str(e))) from None
    if output is not OutputFormat.table:
        emit(spot_simulation(st, results), output)
    else:
        show(out, st, results, False)
    if plot_file is not None:
        (out if output is OutputFormat.table else err).print(f"Plot written to {plot_file}")


def _already_running(settings: Settings) -> bool:
    """Whether this home's controller runs and answers: at once, or, while its process lives
    (server.json), within BUSY_WAIT_SECONDS. A controller busy adopting its fleet on a loaded
    machine can miss the 2 s health check; starting another one then only failed on its lock
    ("another fleetserve controller is running", exit 1: chaos soak, #28)."""
    client = Client(settings=settings, auto_start=False)
    try:
        if client.healthy():
            return True
        deadline = time.monotonic() + BUSY_WAIT_SECONDS
        state = "missing"
        while server_pid(settings) is not None and time.monotonic() < deadline:
            state = client.health()[0]
            if state == "ok":
                return True
            time.sleep(0.2)
        # Its process lives and takes connections without answering them in time (too many
        # held open): it runs; another would only fail on its lock.
        return state == "busy" and server_pid(settings) is not None
    finally:
        client.close()


@server_app.command("start")
def server_start(
    host: Annotated[
        str | None,
        typer.Option(help="Address to listen on (default 127.0.0.1); beyond loopback needs TLS"),
    ] = None,
    port: Annotated[int | None, typer.Option(help="API port (FLEETSERVE_API_PORT)")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(help="A Host name clients use to reach the API (repeatable)"),
    ] = None,
) -> None:
    """Start the controller in the background (the CLI also does it on demand)."""
    settings = Settings.from_env()
    changes: dict[str, object] = {}
    if host is not None:
        changes["api_host"] = host
    if port is not None:
        changes["api_port"] = port
    if tls_cert is not None:
        changes["tls_certfile"] = str(tls_cert.resolve())
    if tls_key is not None:
        changes["tls_keyfile"] = str(tls_key.resolve())
    if allowed_host:
        changes["allowed_hosts"] = (*settings.allowed_hosts, *allowed_host)
    settings = dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
    try:
        settings.check_exposure()
        if _already_running(settings):
            out.print(f"Controller already running on port {settings.api_port}.")
            return
        pid = start_server(settings)
    except FleetserveError as e:
        raise _fail(e) from None
    where = f"{settings.api_scheme}://{settings.api_host}:{settings.api_port}"
    out.print(f"Controller started (pid {pid}) on {where}.", highlight=False)
    if not is_loopback(settings.api_host):
        out.print(
            f"Remote clients: FLEETSERVE_API_URL=https://<this host>:{settings.api_port} and "
            f"FLEETSERVE_API_TOKEN=<the token in {settings.token_file}> "
            "(+ FLEETSERVE_API_CA if the certificate's CA is private).",
            highlight=False,
        )


@server_app.command("stop")
def server_stop() -> None:
    """Stop the controller. Replicas and load balancers keep serving; a restart adopts them."""
    if stop_server(Settings.from_env()):
        out.print("Controller stopped.")
    else:
        out.print("No controller is running.")


@server_app.command("status")
def server_status() -> None:
    """Whether the controller runs, and where."""
    settings = Settings.from_env()
    pid = server_pid(settings)
    try:
        state, why = Client(settings=settings, auto_start=False).health()
    except FleetserveError as e:
        raise _fail(e) from None
    healthy = state == "ok"
    if pid is None and not healthy:
        out.print("Controller: not running." if state == "missing" else f"Controller: {why}.")
        raise typer.Exit(1)
    shown = "running" if healthy else f"busy ({why})" if state == "busy" else "not answering"
    out.print(
        f"Controller: {shown} (pid {pid}) on 127.0.0.1:{settings.api_port}, home {settings.home}"
    )


def main() -> None:
    try:
        app()
    except FleetserveError as e:  # raised outside a command's own handling (settings, say)
        err.print(f"[red]Error:[/] {e.message}", highlight=False)
        sys.exit(e.exit_code)
    except ValidationError as e:  # an answer that is not the controller's (or a newer one)
        err.print(
            f"[red]Error:[/] the controller's answer was not understood: {e.error_count()} "
            "problem(s), first: " + str(e.errors()[0].get("msg", "")),
            highlight=False,
        )
        sys.exit(1)
