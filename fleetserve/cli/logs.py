"""`fleetserve logs`: a replica's output, the controller's or a load balancer's log."""

from __future__ import annotations

from typing import Annotated

import typer

from fleetserve.cli.common import fail
from fleetserve.cli.completion import complete_service
from fleetserve.cli.output import quiet_broken_pipe
from fleetserve.client import Client
from fleetserve.core.errors import FleetserveError, InvalidSpec


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
        raise fail(e) from None
