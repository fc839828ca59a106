"""What the commands share: the consoles, the error exit, the options of several commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleetserve.cli.completion import complete_service
from fleetserve.cli.envs import overrides
from fleetserve.cli.output import OutputFormat
from fleetserve.cli.safe import safe
from fleetserve.core.errors import FleetserveError

out = Console(width=None if sys.stdout.isatty() else 200)
# Messages on stderr are never wrapped by rich: a long error keeps its `command` whole.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200, soft_wrap=True)


def fail(e: FleetserveError) -> typer.Exit:
    err.print(f"[red]Error:[/] {safe(e.message)}", highlight=False, soft_wrap=True)
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


def env_overrides(
    env: list[str] | None, env_file: Path | None, secret: list[str] | None
) -> tuple[dict[str, str], dict[str, str]]:
    return overrides(env, env_file, secret, os.environ)


def print_warnings(lines: list[str], to: Console | None = None) -> None:
    for line in lines:
        (to or out).print(f"[yellow]warning:[/] {safe(line)}", highlight=False, soft_wrap=True)


WaitOption = Annotated[
    bool,
    typer.Option("--wait", help="Show progress until the version serves alone (or fails)."),
]
