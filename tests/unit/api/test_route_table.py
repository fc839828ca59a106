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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from fleetserve.api.app import create_app
from fleetserve.api.auth import DASHBOARD_PATHS, OPEN_PATHS, STATIC_PREFIX
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings
from tests.unit.api.conftest import TOKEN

PINNED = Path(__file__).parent / "pinned"
SCHEMA = PINNED / "openapi.json"
ROUTES = PINNED / "routes.txt"


@dataclass(frozen=True)
class Row:
    method: str
    path: str
    status: int | None
    shown: bool
    name: str


def rows(app: FastAPI) -> Iterator[Row]:
    """Every (method, path) the app answers, through the routers it includes (FastAPI 0.16x
    keeps an included router as one entry of `app.routes`; earlier ones copy its routes)."""
    try:
        from fastapi.routing import iter_route_contexts  # type: ignore[attr-defined]
    except ImportError:
        routes = list(app.routes)
    else:
        routes = list(iter_route_contexts(app.routes))
    for r in routes:
        methods = getattr(r, "methods", None)
        if methods is None:  # a mount: the app has none
            raise AssertionError(f"a route without methods: {r!r}")
        for method in sorted(methods):
            status = getattr(r, "status_code", None)
            yield Row(method, r.path, status, bool(r.include_in_schema), str(r.name))


def schema_text(app: FastAPI) -> str:
    """The schema as canonical bytes: keys sorted (the order of `paths` follows the order
    routes were added in, which grouping them into routers changes and nothing reads)."""
    return json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n"


def route_table(app: FastAPI) -> str:
    """One line per method and path: `METHOD PATH STATUS schema|hidden NAME`, sorted."""
    lines = [
        f"{r.method} {r.path} {r.status or '-'} {'schema' if r.shown else 'hidden'} {r.name}"
        for r in rows(app)
    ]
    return "\n".join(sorted(lines)) + "\n"


def test_the_schema_is_the_pinned_one(ctl: Controller) -> None:
    assert schema_text(create_app(ctl, token=TOKEN)) == SCHEMA.read_text()


def test_the_routes_are_the_pinned_ones(ctl: Controller) -> None:
    assert route_table(create_app(ctl, token=TOKEN)) == ROUTES.read_text()


def test_every_route_needs_the_token(ctl: Controller) -> None:
    app = create_app(ctl, token=TOKEN)
    client = TestClient(app, base_url="http://127.0.0.1")  # no Authorization header
    called = 0
    for r in rows(app):
        if r.path in OPEN_PATHS | DASHBOARD_PATHS or r.path.startswith(STATIC_PREFIX):
            continue
        if r.method == "HEAD":
            continue
        path = re.sub(r"\{[^}]+\}", "1", r.path)  # a value for each path parameter
        answer = client.request(r.method, path, json={} if r.method != "GET" else None)
        assert answer.status_code == 401, (r.method, r.path, answer.status_code)
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


def test_an_unknown_route_or_method_answers_in_the_apis_error_shape(
    api: tuple[TestClient, Controller],
) -> None:
    client, _ = api
    missing = client.get("/api/v1/nosuch")
    assert missing.status_code == 404
    assert missing.json()["error"]["kind"] == "not_found"
    assert "GET /api/v1/nosuch" in missing.json()["error"]["message"]
    wrong = client.put("/api/v1/health", json={})
    assert wrong.status_code == 405 and wrong.json()["error"]["kind"] == "invalid_spec"
    assert "allow" in {k.lower() for k in wrong.headers}
