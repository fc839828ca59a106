"""`fleetserve server start|stop|status`: this home's background controller."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer

from fleetserve.cli.common import fail, out
from fleetserve.client import (
    BUSY_WAIT_SECONDS,
    Client,
    controller_of,
    server_pid,
    start_server,
    stop_controllers,
)
from fleetserve.core.errors import FleetserveError
from fleetserve.home.folder import RunningController, running_controllers
from fleetserve.home.settings import HomeSettings, is_loopback

server_app = typer.Typer(help="Manage the background controller.", no_args_is_help=True)


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
        pid, ours = start_server(settings)
    except FleetserveError as e:
        raise fail(e) from None
    where = f"{settings.api_scheme}://{settings.api_host}:{settings.api_port}"
    if not ours:
        # (another `server start` at the same moment won: one controller runs, as asked)
        out.print(f"Controller already running (pid {pid}) on {where}.", highlight=False)
        return
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
            raise fail(e) from None
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
    # (no token at all: the answer cannot be checked, the process is known from its file)
    with Client(settings=settings, auto_start=False) as client:
        mine = client.home_hashes()
    try:
        with httpx.Client(trust_env=False, verify=False, timeout=2) as probe:
            body = probe.get(url).json()
    except (httpx.HTTPError, ValueError):
        return None
    said = body.get("home_hash") if isinstance(body, dict) else None
    if not isinstance(body, dict) or (mine and not (isinstance(said, str) and said in mine)):
        return None
    return str(body.get("role") or "")
