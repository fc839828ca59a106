"""`fleetserve`: the typer app, assembled from the command groups' modules.

services.py (validate, up, update, rollback, promote, down), status.py (status, events),
logs.py, simulate.py, server.py, pools.py (pool, jobs), chaos.py and dashboard.py hold the
commands; common.py what several share. The CLI reaches the controller only through the SDK
(fleetserve.client), never its modules (an import-linter contract)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from fleetserve.cli import logs, services, status
from fleetserve.cli.chaos import chaos_app
from fleetserve.cli.common import err
from fleetserve.cli.dashboard import dashboard
from fleetserve.cli.pools import jobs_app, pool_app
from fleetserve.cli.safe import safe
from fleetserve.cli.server import server_app
from fleetserve.cli.simulate import simulate_app
from fleetserve.core.errors import FleetserveError

app = typer.Typer(
    help="Serve any model server as a fleet of replicas behind one endpoint.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (docs/output.md)
    pretty_exceptions_enable=False,
)
# In the order `fleetserve --help` lists them: a service's life, then what it shows, then
# the tools and the groups.
app.command("dashboard")(dashboard)
app.command()(services.validate)
app.command()(services.up)
app.command()(services.update)
app.command()(services.rollback)
app.command()(services.promote)
app.command()(status.status)
app.command()(status.events)
app.command()(logs.logs)
app.command()(services.down)
app.add_typer(simulate_app, name="simulate")
app.add_typer(server_app, name="server")
app.add_typer(chaos_app, name="chaos")
app.add_typer(pool_app, name="pool")
app.add_typer(jobs_app, name="jobs")


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
            f"[red]Error:[/] '{safe(bad)}': an argument that is not UTF-8 text "
            "(names, values and paths must be)",
            highlight=False,
        )
        sys.exit(2)
    try:
        app()
    except FleetserveError as e:  # raised outside a command's own handling (settings, say)
        err.print(f"[red]Error:[/] {safe(e.message)}", highlight=False)
        sys.exit(e.exit_code)
    except ValidationError as e:  # an answer that is not the controller's (or a newer one)
        err.print(
            f"[red]Error:[/] the controller's answer was not understood: {e.error_count()} "
            "problem(s), first: " + str(e.errors()[0].get("msg", "")),
            highlight=False,
        )
        sys.exit(1)
