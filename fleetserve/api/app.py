"""The FastAPI application: thin handlers over `Controller`, errors mapped in one place.

The app is assembled here: the controller's lifespan, the guard and ETag middleware, the
dashboard, the error handlers (fleetserve/api/errors.py) and one router per resource
(fleetserve/api/routes/). The handlers reach the controller through `app.state.controller`
(the `Ctl` dependency of fleetserve/api/deps.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from fleetserve._version import __version__
from fleetserve.api.auth import ApiGuard, Sessions, allowed_host_names
from fleetserve.api.dashboard import add_dashboard
from fleetserve.api.deps import writes_when_active
from fleetserve.api.errors import add_error_handlers
from fleetserve.api.etag import ETags
from fleetserve.api.routes import ROUTERS
from fleetserve.controller.controller import Controller
from fleetserve.home.folder import ensure_token
from fleetserve.home.settings import home_hash
from fleetserve.lb.wake import wake_token


def create_app(
    controller: Controller,
    on_stopped: Callable[[], None] | None = None,
    token: str | None = None,
    on_started: Callable[[], None] | None = None,
) -> FastAPI:
    """The REST API over `controller`. Every route but /health needs the `token` (see
    fleetserve.api.auth); `None` makes and reads the token file of the controller's home."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await controller.start()
        if on_started is not None:
            on_started()
        yield
        await controller.stop()
        if on_stopped is not None:
            on_stopped()

    app = FastAPI(
        title="fleetserve",
        version=__version__,
        lifespan=lifespan,
        dependencies=[Depends(writes_when_active)],
        # No /docs, no /redoc: FastAPI's pages load Swagger UI / ReDoc from a CDN (unpinned,
        # no integrity check) into this origin, where the dashboard's session cookie is
        # valid. The schema stays at /openapi.json (behind the token) for any local viewer.
        docs_url=None,
        redoc_url=None,
    )
    app.state.controller = controller  # what the routes' `Ctl` dependency reads
    ctl = controller

    def wake_secret(name: str) -> str | None:
        """What the service's LB sends with its wake-up call (derived from its secret)."""
        svc = ctl.store.get_service(name)
        return wake_token(svc.lb_secret) if svc is not None and svc.lb_secret else None

    api_token = token if token is not None else ensure_token(ctl.settings.token_file)
    app.state.home_hash = home_hash(ctl.settings.home, api_token)  # (the open /health's)
    sessions = Sessions(api_token)  # the dashboard's cookies, checked by the guard too
    app.state.sessions = sessions  # and by the connection guard (fleetserve.api.connections)
    add_dashboard(app, api_token, sessions, secure_cookie=ctl.settings.tls_certfile is not None)
    app.add_middleware(ETags)  # inside the guard: only answers it let through are tagged
    app.add_middleware(
        ApiGuard,
        token=api_token,
        sessions=sessions,
        hosts=allowed_host_names(ctl.settings),
        wake_secret=wake_secret,
        max_body=ctl.settings.max_body_bytes,
    )
    add_error_handlers(app, ctl)
    for router in ROUTERS:
        app.include_router(router)
    return app
