"""`fleetserve validate, up, update, rollback, promote, down`: a service's life."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from fleetserve.api.models import ServiceInfo
from fleetserve.cli.common import (
    EnvFileOption,
    EnvOption,
    ResultOption,
    SecretOption,
    ServiceArg,
    WaitOption,
    YesOption,
    env_overrides,
    err,
    fail,
    out,
    print_warnings,
)
from fleetserve.cli.completion import complete_service
from fleetserve.cli.output import OutputFormat, emit
from fleetserve.cli.progress import Progress
from fleetserve.cli.render import styled
from fleetserve.cli.safe import safe
from fleetserve.client import Client, current_folder
from fleetserve.core.errors import FleetserveError, InvalidSpec, ServiceFailed
from fleetserve.oshelpers import netcaps
from fleetserve.spec.admission import deploy_problems
from fleetserve.spec.compat import compat_warnings
from fleetserve.spec.exposure import exposure_warning, override_host
from fleetserve.spec.loader import load_spec_file, require_values
from fleetserve.spec.models import FLEETSERVE_INFRAS


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
        envs, secrets = env_overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        try:
            require_values(spec)  # SkyPilot's parser refuses a null env and a null secret
        except InvalidSpec as e:
            raise InvalidSpec(f"{file}: {e.message}") from None
        if infra is not None and infra.split("/")[0] not in FLEETSERVE_INFRAS:
            raise InvalidSpec(
                f"infra {infra!r} is not available; supported: {', '.join(FLEETSERVE_INFRAS)}"
            )
        here = Path(current_folder())
    except InvalidSpec as e:
        raise fail(e) from None
    if infra is not None:  # as `up --infra` overrides the YAML's resources.infra
        spec = spec.model_copy(
            update={"resources": spec.resources.model_copy(update={"infra": infra})}
        )
    infra = spec.requested_infra() or "local"
    mode = os.environ.get(netcaps.MODE_ENV, "auto")
    not_here = deploy_problems(spec, infra, mode if mode in netcaps.MODES else "auto", here)
    warnings = compat_warnings(spec, infra)
    pool = spec.service.pool
    if pool is not None and spec.run is not None:
        # SkyPilot's `sky jobs pool apply` warns the same and runs its own placeholder.
        warnings.append("run: ignored in a pool (its jobs bring their own `run`)")
    print_warnings(warnings)
    for line in not_here:
        out.print(f"[red]cannot run here:[/] {safe(line)}", highlight=False, soft_wrap=True)
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
            f"[green]OK[/] {safe(str(file))}: valid ({summary}), but `fleetserve up` refuses it "
            "here (cannot run here: above)",
            highlight=False,
            soft_wrap=True,
        )
        if strict:
            raise typer.Exit(2)
        return
    out.print(f"[green]OK[/] {safe(str(file))}: {summary}", highlight=False, soft_wrap=True)


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
            extra = f" - {safe(r.reason)}" if r.reason else ""
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
    return f"{safe(svc.name)}{of}: {parts} (target {svc.target_replicas})"


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
            prog.line(f"    [dim]replica {r.replica_id}:[/] {safe(line)}")
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
        if name is not None and not name.strip():
            raise InvalidSpec("-n/--name is empty: give the service a name, or leave -n out")
        envs, secrets = env_overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)  # a clear local error before anything
        require_values(spec)
        if host is not None:
            spec = override_host(spec, host)
        warning = exposure_warning(spec, infra or "local")
        if warning is not None:
            err.print(warning, highlight=False)
        client = Client()
        svc = client.up_file(file, name, infra, envs, secrets, host)
        print_warnings(svc.warnings, err if quiet else out)
        lo, hi = svc.min_replicas, svc.max_replicas
        size = f"{lo}" if lo == hi else f"{lo}..{hi}"
        accepted = f"Service [bold]{safe(svc.name)}[/] accepted: {size} replica(s)."
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
        raise fail(e) from None
    if quiet:
        emit(svc, output)
        return
    if svc.status == "READY":
        out.print(f"Service [bold]{safe(svc.name)}[/] is READY.")
    else:
        out.print(
            f"Service [bold]{safe(svc.name)}[/] is scaled to zero: the first request starts "
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
        svc = client.through_restarts(lambda: client.service(name))
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
        envs, secrets = env_overrides(env, env_file, secret)
        spec, _ = load_spec_file(file, envs, secrets)
        require_values(spec)
        client = Client()
        svc = client.update_file(name, file, mode, traffic_percent, envs, secrets)
        print_warnings(svc.warnings, err if quiet else out)
        version = svc.active_version
        in_place = svc.serving_version == version
        with Progress(out, err, quiet) as prog:
            if not in_place:  # (in place: the result says so, below)
                if svc.traffic_percent is not None:
                    prog.line(
                        f"Canary: version {version} of {safe(name)} takes "
                        f"{svc.traffic_percent}% of requests once a replica of it is READY."
                    )
                else:
                    prog.line(f"Rolling out version {version} of {safe(name)} ({svc.update_mode}).")
                if not detach:
                    svc = _follow_rollout(client, name, version, prog)
    except FleetserveError as e:
        raise fail(e) from None
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
        raise fail(e) from None


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
        raise fail(e) from None


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
                err.print(f"[red]{safe(n)}:[/] {safe(e.message)}", highlight=False, soft_wrap=True)
        failed = bool(refused)
        for n in requested:
            out.print(f"Taking down {n}...")
            left = client.wait_gone(n, purge=purge)
            if left is None:
                out.print(f"Service [bold]{n}[/] is down.")
            else:
                failed = True
                why = left.failure_reason or left.status
                err.print(f"[red]{safe(n)}:[/] {safe(why)}", highlight=False)
        if failed:
            raise typer.Exit(refused[0].exit_code if refused else 1)
    except FleetserveError as e:
        raise fail(e) from None
