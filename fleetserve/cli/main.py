"""`fleetserve`: up, status, logs, down, validate and server management."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import httpx
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
from fleetserve.cli.progress import Progress
from fleetserve.cli.render import (
    event_line,
    events_table,
    replicas_table,
    services_table,
    styled,
)
from fleetserve.client import (
    BUSY_WAIT_SECONDS,
    Client,
    controller_of,
    server_pid,
    start_server,
    stop_controllers,
)
from fleetserve.core.errors import (
    FleetserveError,
    InvalidSpec,
    NotFound,
    ServiceFailed,
    TransientError,
)
from fleetserve.home.folder import RunningController, running_controllers
from fleetserve.home.settings import HomeSettings, is_loopback
from fleetserve.oshelpers import netcaps
from fleetserve.spec.admission import deploy_problems
from fleetserve.spec.compat import compat_warnings
from fleetserve.spec.exposure import exposure_warning, override_host
from fleetserve.spec.loader import load_spec_file, require_values
from fleetserve.spec.models import FLEETSERVE_INFRAS

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


def _show_version(value: bool) -> None:
    if value:
        from fleetserve._version import __version__

        print(f"fleetserve {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            help="Print fleetserve's version and exit.",
        ),
    ] = False,
) -> None:
    """Serve any model server as a fleet of replicas behind one endpoint."""


out = Console(width=None if sys.stdout.isatty() else 200)
# Messages on stderr are never wrapped by rich: a long error keeps its `command` whole.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200, soft_wrap=True)


def _fail(e: FleetserveError) -> typer.Exit:
    err.print(f"[red]Error:[/] {escape(e.message)}", highlight=False, soft_wrap=True)
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

YesOption = Annotated[
    bool,
    typer.Option(
        "--yes",
        "-y",
        help="Skip confirmation (accepted for `sky serve` habits: fleetserve asks none).",
    ),
]

ResultOption = Annotated[
    OutputFormat,
    typer.Option(
        "-o",
        "--output",
        case_sensitive=False,
        help="table (default: progress, then a summary), json or yaml: no progress, only the "
        "result as the REST API's body",
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
    infra: Annotated[
        str | None,
        typer.Option(help="The infra `up --infra` would get (local, ray): checked as up does"),
    ] = None,
) -> None:
    """Check a service YAML (with the --env / --secret values `up` would get) as SkyPilot's
    parser does: print what is wrong, exit 2 if anything is. What is valid but `up` (or
    `pool apply`) would refuse here (multi-node, container images, SkyPilot volumes, no
    `run`, a missing workdir or file, a fixed port several replicas cannot share) is printed
    as `cannot run here:` lines; --strict makes those exit 2 as well."""
    try:
        envs, secrets = _overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        try:
            require_values(spec)  # SkyPilot's parser refuses a null env and a null secret
        except InvalidSpec as e:
            raise InvalidSpec(f"{file}: {e.message}") from None
        if infra is not None and infra.split("/")[0] not in FLEETSERVE_INFRAS:
            raise InvalidSpec(
                f"infra {infra!r} is not available; supported: {', '.join(FLEETSERVE_INFRAS)}"
            )
    except InvalidSpec as e:
        raise _fail(e) from None
    if infra is not None:  # as `up --infra` overrides the YAML's resources.infra
        spec = spec.model_copy(
            update={"resources": spec.resources.model_copy(update={"infra": infra})}
        )
    infra = spec.requested_infra() or "local"
    mode = os.environ.get(netcaps.MODE_ENV, "auto")
    not_here = deploy_problems(spec, infra, mode if mode in netcaps.MODES else "auto", Path.cwd())
    warnings = compat_warnings(spec, infra)
    pool = spec.service.pool
    if pool is not None and spec.run is not None:
        # SkyPilot's `sky jobs pool apply` warns the same and runs its own placeholder.
        warnings.append("run: ignored in a pool (its jobs bring their own `run`)")
    _print_warnings(warnings)
    for line in not_here:
        out.print(f"[red]cannot run here:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if pool is not None:
        lo, hi = pool.bounds()
        size = f"{lo}..{hi}" if pool.autoscaled else str(lo)
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


def _print_warnings(lines: list[str], to: Console | None = None) -> None:
    for line in lines:
        (to or out).print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)


_SEEDED = -1  # a key of `seen`: the first view was taken
_HISTORY = ("PREEMPTED",)


def _print_changes(
    svc: ServiceInfo, seen: dict[int, str], prog: Progress, versions: bool = False
) -> None:
    """One line per replica whose status changed since the last call. Replicas that had
    already ended at the first call (an older version's failed rows) are history: not shown."""
    if _SEEDED not in seen:
        seen[_SEEDED] = ""
        seen.update(
            {
                r.replica_id: r.status
                for r in svc.replicas
                if r.status in _HISTORY or "FAIL" in r.status
            }
        )
    for r in svc.replicas:
        if seen.get(r.replica_id) != r.status:
            seen[r.replica_id] = r.status
            extra = f" - {escape(r.reason)}" if r.reason else ""
            which = f"{r.replica_id} (v{r.version})" if versions else str(r.replica_id)
            prog.line(f"  replica {which}: {styled(r.status)}{extra}")


def _fleet_state(svc: ServiceInfo, version: int | None = None) -> str:
    """The spinner's line: how many replicas are where (of one version, if given)."""
    mine = [r for r in svc.replicas if version is None or r.version == version]
    count: dict[str, int] = {}
    for r in mine:
        count[r.status] = count.get(r.status, 0) + 1
    parts = ", ".join(f"{n} {status}" for status, n in sorted(count.items())) or "no replica yet"
    of = f" v{version}" if version is not None else ""
    return f"{escape(svc.name)}{of}: {parts} (target {svc.target_replicas})"


def _last_setup_line(
    client: Client, svc: ServiceInfo, shown: dict[int, str], prog: Progress
) -> None:
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
            prog.line(f"    [dim]replica {r.replica_id}:[/] {escape(line)}")
        return  # one replica's setup is enough to show progress


def _follow_up(client: Client, name: str, prog: Progress) -> ServiceInfo:
    """Show replica status changes until one is READY or the service fails (raises
    ServiceFailed with the reason); while setup runs, its newest log line."""
    seen: dict[int, str] = {_SEEDED: ""}  # a new service: every row it has is news
    shown: dict[int, str] = {}
    prog.line(
        "  (Ctrl-C stops watching; the service keeps launching. `fleetserve up -d` returns "
        "at once.)"
    )
    last_tail = [0.0]

    def show(svc: ServiceInfo) -> None:
        _print_changes(svc, seen, prog)
        prog.state(_fleet_state(svc))
        if not prog.quiet and time.monotonic() - last_tail[0] >= 2.0:
            last_tail[0] = time.monotonic()
            _last_setup_line(client, svc, shown, prog)

    return client.wait_ready(name, math.inf, on_poll=show)


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
    yes: YesOption = False,
    output: ResultOption = OutputFormat.table,
) -> None:
    """Start a service: its replicas and a load balancer; print the endpoint. Progress shows
    on a terminal (on stderr when piped); `-o json|yaml` prints only the service's final view
    (GET /services/NAME's body)."""
    quiet = output is not OutputFormat.table
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
        _print_warnings(svc.warnings, err if quiet else out)
        lo, hi = svc.min_replicas, svc.max_replicas
        size = f"{lo}" if lo == hi else f"{lo}..{hi}"
        accepted = f"Service [bold]{escape(svc.name)}[/] accepted: {size} replica(s)."
        if detach:  # the acceptance is the result
            if quiet:
                emit(svc, output)
            else:
                out.print(accepted)
                out.print(f"Check it with `fleetserve status {svc.name}`.", highlight=False)
            return
        with Progress(out, err, quiet) as prog:
            prog.line(accepted)
            try:
                svc = _follow_up(client, svc.name, prog)
            except KeyboardInterrupt:
                prog.line(f"Stopped watching; {svc.name} keeps launching (`fleetserve status`).")
                return
    except FleetserveError as e:
        raise _fail(e) from None
    if quiet:
        emit(svc, output)
        return
    if svc.status == "READY":
        out.print(f"Service [bold]{escape(svc.name)}[/] is READY.")
    else:
        out.print(
            f"Service [bold]{escape(svc.name)}[/] is scaled to zero: the first request starts "
            "a replica (and waits for it)."
        )
    out.print(f"Endpoint: {svc.endpoint}", highlight=False)


_ENDED = ("SHUTTING_DOWN", "PREEMPTED")


def _rollout_failed(svc: ServiceInfo, version: int) -> ServiceFailed:
    """Why waiting for `version` ended in failure, and the commands that go on from there."""
    failed = [r for r in svc.replicas if r.version == version and "FAIL" in r.status]
    logs = (
        f"; `fleetserve logs {svc.name} {failed[-1].replica_id} --no-follow` shows its output"
        if failed and "fleetserve logs" not in (svc.failure_reason or "")
        else ""
    )
    return ServiceFailed(
        f"version {version} of {svc.name} failed; version {svc.serving_version} keeps "
        f"serving. {(svc.failure_reason or '').rstrip('.')}. `fleetserve rollback {svc.name}` "
        f"drops version {version}{logs}."
    )


def _watch_version(
    client: Client,
    name: str,
    version: int,
    prog: Progress,
    done: Callable[[ServiceInfo], bool],
    moved: Callable[[ServiceInfo], str],
) -> ServiceInfo:
    """Show replica changes until `done` holds; the rollout failing or the service moving to
    another version (`moved` says how) ends the wait with an error."""
    seen: dict[int, str] = {}
    while True:
        svc = client.service(name)
        _print_changes(svc, seen, prog, versions=True)
        prog.state(_fleet_state(svc, version))
        if svc.active_version != version:
            raise FleetserveError(moved(svc))
        if svc.failure_reason:
            raise _rollout_failed(svc, version)
        if done(svc):
            return svc
        time.sleep(0.5)


def _follow_rollout(client: Client, name: str, version: int, prog: Progress) -> ServiceInfo:
    """Until `version` serves (or, for a canary, has a READY replica), or the rollout fails."""

    def done(svc: ServiceInfo) -> bool:
        return svc.serving_version == version or (
            svc.traffic_percent is not None
            and any(r.version == version and r.status == "READY" for r in svc.replicas)
        )

    return _watch_version(
        client,
        name,
        version,
        prog,
        done,
        lambda svc: f"the rollout of version {version} was abandoned (rollback)",
    )


def _settle_on(client: Client, name: str, version: int, prog: Progress) -> ServiceInfo:
    """Until `version` serves alone (`promote`, `rollback`): it serves, one of its replicas is
    READY and no other version's replica is left running."""

    def done(svc: ServiceInfo) -> bool:
        alive = [r for r in svc.replicas if r.status not in _ENDED and "FAIL" not in r.status]
        return (
            svc.serving_version == version
            and svc.traffic_percent is None
            and all(r.version == version for r in alive)
            and any(r.status == "READY" for r in alive)
        )

    return _watch_version(
        client,
        name,
        version,
        prog,
        done,
        lambda svc: f"{name} moved on to version {svc.active_version} while waiting for {version}",
    )


@app.command()
def update(
    name: Annotated[
        str, typer.Argument(help="Service to update.", autocompletion=complete_service)
    ],
    file: Annotated[Path, typer.Argument(help="The new service YAML.")],
    mode: Annotated[str, typer.Option(help="rolling or blue_green")] = "rolling",
    traffic_percent: Annotated[
        int | None,
        typer.Option(help="A canary: send this % of requests (1..99) to the new version"),
    ] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once accepted.")] = False,
    env: EnvOption = None,
    env_file: EnvFileOption = None,
    secret: SecretOption = None,
    yes: YesOption = False,
    output: ResultOption = OutputFormat.table,
) -> None:
    """Roll out a new version with no failed request (rolling, blue-green or canary)."""
    quiet = output is not OutputFormat.table
    try:
        if traffic_percent is not None and not 1 <= traffic_percent <= 99:
            raise InvalidSpec(
                f"--traffic-percent {traffic_percent}: a canary's share of requests, 1..99 "
                f"(all of them: update without it, or `fleetserve promote {name}` a canary)"
            )
        envs, secrets = _overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        require_values(spec)
        client = Client()
        svc = client.update_file(name, file, mode, traffic_percent, envs, secrets)
        _print_warnings(svc.warnings, err if quiet else out)
        version = svc.active_version
        in_place = svc.serving_version == version
        with Progress(out, err, quiet) as prog:
            if not in_place:  # (in place: the result says so, below)
                if svc.traffic_percent is not None:
                    prog.line(
                        f"Canary: version {version} of {escape(name)} takes "
                        f"{svc.traffic_percent}% of requests once a replica of it is READY."
                    )
                else:
                    prog.line(
                        f"Rolling out version {version} of {escape(name)} ({svc.update_mode})."
                    )
                if not detach:
                    svc = _follow_rollout(client, name, version, prog)
    except FleetserveError as e:
        raise _fail(e) from None
    if quiet:
        emit(svc, output)
    elif in_place:
        out.print(f"Version {version} serves: the replicas moved to it in place.")
    elif detach:
        out.print(f"Follow it with `fleetserve status {name}`.", highlight=False)
    elif svc.traffic_percent is not None and svc.serving_version != version:
        out.print(
            f"Canary version {version} takes {svc.traffic_percent}% of requests; "
            f"`fleetserve promote {name}` to roll it out, `fleetserve rollback {name}` to drop it.",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"Version {version} serves. `fleetserve rollback {name}` returns to the last one.",
            highlight=False,
            soft_wrap=True,
        )


WaitOption = Annotated[
    bool,
    typer.Option("--wait", help="Show progress until the version serves alone (or fails)."),
]


@app.command()
def rollback(name: ServiceArg, wait: WaitOption = False) -> None:
    """Return to the version that served before (abandons a rollout in progress)."""
    try:
        client = Client()
        svc = client.rollback(name)
        out.print(f"{name}: rolling back to version {svc.active_version}.", highlight=False)
        if wait:
            with Progress(out, err) as prog:
                svc = _settle_on(client, name, svc.active_version, prog)
            out.print(f"Version {svc.active_version} serves.", highlight=False)
        else:
            out.print(f"Follow it with `fleetserve status {name}` (or --wait).", highlight=False)
    except FleetserveError as e:
        raise _fail(e) from None


@app.command()
def promote(name: ServiceArg, wait: WaitOption = False) -> None:
    """Roll a canary out to the whole fleet."""
    try:
        client = Client()
        svc = client.promote(name)
        out.print(
            f"{name}: promoting version {svc.active_version} to the whole fleet.", highlight=False
        )
        if wait:
            with Progress(out, err) as prog:
                svc = _settle_on(client, name, svc.active_version, prog)
            out.print(f"Version {svc.active_version} serves all requests.", highlight=False)
        else:
            out.print(f"Follow it with `fleetserve status {name}` (or --wait).", highlight=False)
    except FleetserveError as e:
        raise _fail(e) from None


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
            # A reason's line is never wrapped by rich (its `command` stays whole); tables are.
            out.print(part, highlight=False, soft_wrap=isinstance(part, Text))
    except FleetserveError as e:
        raise _fail(e) from None


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
            parts.append(Text.from_markup(f"[red]{escape(s.name)}:[/] {escape(s.failure_reason)}"))
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
    controller: Annotated[
        bool,
        typer.Option(
            "--controller",
            help="The controller's log (with NAME: only its lines that name the service).",
        ),
    ] = False,
    load_balancer: Annotated[
        bool, typer.Option("--load-balancer", help="The service's load-balancer log.")
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow/--no-follow",
            "-f",
            help="Keep printing new lines until Ctrl-C (the default, as `sky serve logs`); "
            "--no-follow prints what there is and returns. A replica that has ended returns "
            "either way.",
        ),
    ] = True,
    tail: Annotated[
        int,
        typer.Option(
            "--tail",
            min=0,
            max=10_000,
            help="Only the last N lines (0, the default: all of them), then follow.",
        ),
    ] = 0,
) -> None:
    """Print a replica's output (setup and run), or the controller's or load balancer's log.
    Follows by default (Ctrl-C stops); --no-follow for scripts."""
    last = tail or None
    try:
        if controller and load_balancer:
            raise InvalidSpec("--controller and --load-balancer: give one")
        if controller and replica_id is not None:
            raise InvalidSpec("--controller takes a service NAME, not a replica id")
        if load_balancer and replica_id is not None:
            raise InvalidSpec("--load-balancer takes a service NAME, not a replica id")
        client = Client()
        if controller:
            lines = client.component_logs("controller", name, follow, last)
        elif load_balancer:
            if name is None:
                raise InvalidSpec("--load-balancer needs a service name")
            lines = client.component_logs("load-balancer", name, follow, last)
        else:
            if name is None or replica_id is None:
                raise InvalidSpec(
                    "give NAME and REPLICA_ID, or --controller [NAME], or NAME --load-balancer"
                )
            lines = client.replica_logs(name, replica_id, follow, last)
        for line in lines:
            print(line, flush=True)
    except KeyboardInterrupt:
        return
    except BrokenPipeError:  # `fleetserve logs NAME 1 | head`
        quiet_broken_pipe()
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
    yes: YesOption = False,
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
        refused: list[FleetserveError] = []
        requested = []
        for n in names:
            try:
                client.down(n, purge)
                requested.append(n)
            except FleetserveError as e:
                if len(names) == 1:
                    raise
                # The others are still taken down (a full disk refuses every write, say,
                # and each service's processes are stopped all the same).
                refused.append(e)
                err.print(f"[red]{n}:[/] {e.message}", highlight=False, soft_wrap=True)
        failed = bool(refused)
        for n in requested:
            out.print(f"Taking down {n}...")
            left = client.wait_gone(n)
            if left is None:
                out.print(f"Service [bold]{n}[/] is down.")
            else:
                failed = True
                err.print(f"[red]{n}:[/] {left.failure_reason or left.status}", highlight=False)
        if failed:
            raise typer.Exit(refused[0].exit_code if refused else 1)
    except FleetserveError as e:
        raise _fail(e) from None


@app.command()
def simulate(
    ctx: typer.Context,
    trace: Annotated[
        str | None, typer.Option(help="CSV of time_s,qps (or 'Time (min),Requests'); maf1: MAF")
    ] = None,
    burst: Annotated[
        str | None, typer.Option(help="Generated: BASE:PEAK:PERIOD:LENGTH (req/s, seconds)")
    ] = None,
    duration: Annotated[float | None, typer.Option(help="Seconds of the trace to replay")] = None,
    scale: Annotated[float, typer.Option(help="Multiply the trace's rates")] = 1.0,
    policies: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Comma-separated: request_rate,in_flight,skyserve (with --engine: "
            "request_rate,in_flight,queue,kv_cache,ttft, all by default)",
        ),
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
    start: Annotated[
        float, typer.Option(help="With --spot-trace or --engine: seconds of the trace to skip")
    ] = 0.0,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine",
            help="Serve the trace with LLM engine models (batch, queue, KV cache, prefill and "
            "decode) and compare request_rate,in_flight,queue,kv_cache,ttft on TTFT",
        ),
    ] = False,
    ttft_target_ms: Annotated[
        float, typer.Option(help="With --engine: a request above this TTFT is over target")
    ] = 1000.0,
    percentile: Annotated[
        float, typer.Option(help="With --engine: the TTFT percentile the targets are set at")
    ] = 90.0,
    utilization: Annotated[
        float,
        typer.Option(help="With --engine: the share of a replica's capacity targets are set at"),
    ] = 0.8,
    seed: Annotated[int, typer.Option(help="With --engine: requests and lengths")] = 0,
    engine_param: Annotated[
        list[str] | None,
        typer.Option(
            help="With --engine: NAME=VALUE of the engine model or the workload "
            "(docs/autoscaling.md), repeatable"
        ),
    ] = None,
    engine_target: Annotated[
        list[str] | None,
        typer.Option(
            help="With --engine: POLICY=VALUE, a target of your choice instead of the rule's "
            "(e.g. queue=2), repeatable"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The same as -o json")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Replay a request trace through autoscaling policies on a virtual clock and compare them:
    replicas over time, requests over capacity, replica-hours. With --engine, each replica is
    an LLM engine model and policies are compared on time to first token. With --spot-trace,
    compare spot placers on a spot-capacity trace instead: cost, availability, preemptions.
    `-o json|yaml` prints the result as data (docs/output.md)."""
    try:
        output = json_alias(as_json, output)
    except InvalidSpec as e:
        raise _fail(e) from None
    if engine:
        _simulate_engine(
            ctx,
            trace,
            burst,
            duration,
            scale,
            policies,
            min_replicas,
            max_replicas,
            upscale_delay,
            downscale_delay,
            window,
            cold_start,
            ttft_target_ms,
            percentile,
            utilization,
            seed,
            engine_param or [],
            engine_target or [],
            start,
            plot_file,
            spot_trace,
            output,
        )
        return
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
        )
    except ValueError as e:
        raise _fail(InvalidSpec(str(e))) from None
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
    from fleetserve.sim.simulator import load_trace, need_matplotlib
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
            300.0 if cold_start is None else cold_start,
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
        raise _fail(InvalidSpec(str(e))) from None
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


def _already_running(settings: HomeSettings) -> bool:
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
            state = client.reachability()[0]
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
    settings = HomeSettings.from_env()
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
        running = controller_of(settings)
        if running is not None and running.port != settings.api_port and not settings.ha:
            # Without high availability one per home, on whichever port it listens (one on
            # this port is asked below, and waited for while busy).
            out.print(
                f"Controller already running (pid {running.pid}) on {running.where}.",
                highlight=False,
            )
            return
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
def server_stop(
    port: Annotated[
        int | None,
        typer.Option(help="Stop only the controller on this API port (one of several, HA)"),
    ] = None,
) -> None:
    """Stop this home's controllers (every one, with high availability or not; --port: one).
    Replicas and load balancers keep serving; a restart adopts them."""
    settings = HomeSettings.from_env()
    found = running_controllers(settings.home)
    if port is not None:
        found = [c for c in found if c.port == port]
    if not found:
        on = f" on port {port}" if port is not None else ""
        out.print(f"No controller is running for {settings.home}{on}.", highlight=False)
        return
    stop_controllers(found)
    for c in found:
        out.print(f"Controller stopped (pid {c.pid}, {c.where}).", highlight=False)


@server_app.command("status")
def server_status() -> None:
    """Whether this home's controllers run, and where they listen (every one, whatever
    FLEETSERVE_HA and FLEETSERVE_API_PORT say here)."""
    settings = HomeSettings.from_env()
    found = running_controllers(settings.home)
    if not found:
        try:  # one that answers on the port without a server file (an older version's)
            healthy = Client(settings=settings, auto_start=False).healthy()
        except FleetserveError as e:
            raise _fail(e) from None
        if not healthy:
            out.print(f"Controller: not running (home {settings.home}).", highlight=False)
            raise typer.Exit(1)
        out.print(
            f"Controller: running on 127.0.0.1:{settings.api_port}, home {settings.home}",
            highlight=False,
        )
        return
    for c in found:
        role = _health_role(settings, c)
        state = "not answering" if role is None else "running"
        if role is None and c.port == settings.api_port:  # busy (connections held) or gone
            with contextlib.suppress(FleetserveError):
                seen, why = Client(settings=settings, auto_start=False).reachability()
                state = f"busy ({why})" if seen == "busy" else state
        if c.ha and role:
            state += f", {role}"
        out.print(
            f"Controller: {state} (pid {c.pid}) on {c.where}"
            f"{' (high availability)' if c.ha else ''}, home {settings.home}",
            highlight=False,
        )
    with contextlib.suppress(FleetserveError):  # the cgroups or the token scan
        processes = Client(settings=settings, auto_start=False).health().processes
        if processes:
            out.print(f"Local replicas and jobs: {processes}", highlight=False)


def _health_role(settings: HomeSettings, c: RunningController) -> str | None:
    """The controller's role from its health check ("" if it does not say), None if it does
    not answer (as this home's controller)."""
    url = f"{c.url}/api/v1/health"
    try:
        with httpx.Client(trust_env=False, verify=False, timeout=2) as probe:
            body = probe.get(url).json()
        if not isinstance(body, dict) or body.get("home") != str(settings.home):
            return None
        return str(body.get("role") or "")
    except (httpx.HTTPError, ValueError):
        return None


def _not_text_argument() -> str | None:
    """The first command-line argument that is no text (bytes that are not UTF-8, which
    Python keeps as lone surrogates and which no request can carry), shown escaped."""
    for arg in sys.argv[1:]:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def main() -> None:
    bad = _not_text_argument()
    if bad is not None:
        err.print(
            f"[red]Error:[/] '{escape(bad)}': an argument that is not UTF-8 text "
            "(names, values and paths must be)",
            highlight=False,
        )
        sys.exit(2)
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
