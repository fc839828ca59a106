"""The API's routes, one router per resource; `create_app` includes them in this order.

Each handler takes the controller as a dependency (`deps.Ctl`, from `app.state`) and maps it
to the models of fleetserve/api/models.py through fleetserve/api/views.py."""

from __future__ import annotations

from fastapi import APIRouter

from fleetserve.api.routes import chaos, jobs, pools, replicas, server, services, telemetry

ROUTERS: tuple[APIRouter, ...] = (
    server.router,
    services.router,
    replicas.router,
    telemetry.router,
    chaos.router,
    pools.router,
    jobs.router,
)
