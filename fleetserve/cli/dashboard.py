"""`fleetserve dashboard`: a login link to the controller's web page (docs/dashboard.md)."""

from __future__ import annotations

import webbrowser
from typing import Annotated

import typer
from rich.console import Console

from fleetserve.client import Client
from fleetserve.core.errors import FleetserveError
from fleetserve.core.text import visible

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def dashboard(
    open_browser: Annotated[
        bool, typer.Option("--open", help="Open the link in this machine's web browser")
    ] = False,
) -> None:
    """Print a login link to the dashboard (it works once, within two minutes)."""
    try:
        with Client() as client:
            link = client.dashboard_link()
    except FleetserveError as e:
        err.print(f"Error: {visible(e.message, chr(10))}", markup=False)
        raise typer.Exit(e.exit_code) from None
    out.print("Dashboard login link (works once, within 2 minutes):", markup=False)
    out.print(link, markup=False, soft_wrap=True)
    if open_browser and not webbrowser.open(link):
        err.print("No web browser found here: open the link above in yours.", markup=False)
