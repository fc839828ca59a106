"""The REST API's surface is pinned: its OpenAPI schema and its table of routes (method, path,
status code, in the schema or not) equal the files in tests/unit/api/pinned/, made from the
app before its routes were split into one router per resource (fleetserve/api/routes/). A
route added, dropped, renamed or answering another status fails here; a deliberate change
rewrites the files:

    PYTHONPATH=. python -m tests.unit.api.test_route_table

And the token guards every route: each one, called without credentials, is refused (401)
but the health check, the dashboard's static files (no data in them) and its own pages,
which check the session themselves."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from fleetserve.api.app import create_app
from fleetserve.api.auth import DASHBOARD_PATHS, OPEN_PATHS, STATIC_PREFIX
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings
from tests.unit.api.conftest import TOKEN

PINNED = Path(__file__).parent / "pinned"
SCHEMA = PINNED / "openapi.json"
ROUTES = PINNED / "routes.txt"


def schema_text(app: FastAPI) -> str:
    """The schema as canonical bytes: keys sorted (the order of `paths` follows the order
    routes were added in, which grouping them into routers changes and nothing reads)."""
    return json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n"


def route_table(app: FastAPI) -> str:
    """One line per method and path: `METHOD PATH STATUS schema|hidden NAME`, sorted."""
    rows = []
    for r in app.routes:
        if not isinstance(r, Route):
            continue
        status = r.status_code if isinstance(r, APIRoute) else None
        shown = "schema" if r.include_in_schema else "hidden"
        for method in sorted(r.methods or ()):
            rows.append(f"{method} {r.path} {status or '-'} {shown} {r.name}")
    return "\n".join(sorted(rows)) + "\n"


def test_the_schema_is_the_pinned_one(ctl: Controller) -> None:
    assert schema_text(create_app(ctl, token=TOKEN)) == SCHEMA.read_text()


def test_the_routes_are_the_pinned_ones(ctl: Controller) -> None:
    assert route_table(create_app(ctl, token=TOKEN)) == ROUTES.read_text()


def test_every_route_needs_the_token(ctl: Controller) -> None:
    app = create_app(ctl, token=TOKEN)
    client = TestClient(app, base_url="http://127.0.0.1")  # no Authorization header
    called = 0
    for r in app.routes:
        open_ = r.path in OPEN_PATHS | DASHBOARD_PATHS or r.path.startswith(STATIC_PREFIX)
        if not isinstance(r, Route) or open_:
            continue
        path = re.sub(r"\{[^}]+\}", "1", r.path)  # a value for each path parameter
        for method in r.methods or ():
            if method == "HEAD":
                continue
            answer = client.request(method, path, json={} if method != "GET" else None)
            assert answer.status_code == 401, (method, r.path, answer.status_code)
            called += 1
    assert called == 29  # the API's routes, the metrics, the schema


def _write() -> None:
    home = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fleetserve-pin-home")
    settings = Settings.from_env_dict({"FLEETSERVE_HOME": str(home)})
    settings.home.mkdir(mode=0o700, exist_ok=True)
    app = create_app(Controller(settings), token=TOKEN)
    PINNED.mkdir(exist_ok=True)
    SCHEMA.write_text(schema_text(app))
    ROUTES.write_text(route_table(app))


if __name__ == "__main__":
    _write()
