"""What every router of the API shares: the controller behind the app (a dependency, from
`app.state`), the bounded path parameters, the error responses and the YAML check."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as FastApiPath

from fleetserve.api.auth import WRITE_METHODS
from fleetserve.api.models import ErrorResponse
from fleetserve.controller.controller import Controller
from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.loader import parse_spec

PREFIX = "/api/v1"
STANDBY_WRITES = frozenset({"/api/v1/dashboard/login-codes", "/ui/login", "/ui/logout"})
# Path parameters are bounded like the fields they name: a service name is at most 64
# characters, a replica id fits the database's integers.
ServiceName = Annotated[str, FastApiPath(min_length=1, max_length=64)]
ReplicaIdParam = Annotated[int, FastApiPath(ge=1, le=2**31 - 1)]
ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (404, 409, 422)
}


async def controller(request: Request) -> Controller:
    """The controller the app serves (`create_app` puts it in `app.state`). Async, so that
    FastAPI calls it on the loop, not in a worker thread."""
    ctl: Controller = request.app.state.controller
    return ctl


Ctl = Annotated[Controller, Depends(controller)]


async def writes_when_active(request: Request, ctl: Ctl) -> None:
    """A standby serves reads; a write names the active controller (503, kind standby).
    The dashboard's login codes are this controller's own, so a standby makes them too."""
    if request.method in WRITE_METHODS and request.url.path not in STANDBY_WRITES:
        ctl.check_active()


async def parsed_off_loop(ctl: Controller, yaml_text: str) -> None:
    """Parse and check a YAML in a thread, with a deadline: a hostile one can neither
    block the loop that serves every service nor take unbounded time."""
    try:
        await asyncio.wait_for(asyncio.to_thread(parse_spec, yaml_text), ctl.settings.parse_timeout)
    except TimeoutError:
        raise InvalidSpec(
            f"the YAML took longer than {ctl.settings.parse_timeout:g} s to parse"
        ) from None
