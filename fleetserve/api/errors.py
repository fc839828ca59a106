"""Errors mapped to answers in one place: the project's errors by their kind and status, the
database's and the disk's as storage errors, a bad payload as invalid_spec, the rest as 500."""

from __future__ import annotations

import errno
import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.controller.controller import Controller
from fleetserve.core.errors import FleetserveError, Standby

log = logging.getLogger("fleetserve.controller")


def add_error_handlers(app: FastAPI, ctl: Controller) -> None:
    """Answer every error of `app`'s routes as `{"error": {"kind", "message"}}`."""

    @app.exception_handler(OperationalError)
    async def _database_error(_req: Request, exc: OperationalError) -> JSONResponse:
        text = " ".join(str(exc.orig).split())  # one line (PostgreSQL's span several)
        if "full" in text or "No space left" in text:  # SQLite's words; PostgreSQL's
            message, status = f"database or disk is full: {ctl.store.where}", 507
        else:
            message, status = f"the database failed: {text}", 503
        return JSONResponse({"error": {"kind": "storage", "message": message}}, status)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in an API call")
        return JSONResponse(
            {"error": {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"[:300]}},
            status_code=500,
        )

    @app.exception_handler(OSError)
    async def _os_error(_req: Request, exc: OSError) -> JSONResponse:
        if exc.errno == errno.ENOSPC:
            message, status = f"disk is full: {exc.filename or ctl.settings.home}", 507
        else:
            message, status = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 500
        return JSONResponse({"error": {"kind": "storage", "message": message}}, status)

    @app.exception_handler(FleetserveError)
    async def _fleetserve_error(_req: Request, exc: FleetserveError) -> JSONResponse:
        error: dict[str, object] = {"kind": exc.kind, "message": exc.message}
        if isinstance(exc, Standby) and exc.active:
            error["active"] = exc.active  # where writes go
        return JSONResponse({"error": error}, status_code=exc.http_status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> Response:
        # (the routing's own: no such route, a method it does not take) in the API's shape
        if not req.url.path.startswith("/api/"):
            return await http_exception_handler(req, exc)
        kinds = {404: "not_found", 405: "invalid_spec"}
        detail = {404: "no such route", 405: "this route does not take that method"}
        message = detail.get(exc.status_code, str(exc.detail))
        return JSONResponse(
            {
                "error": {
                    "kind": kinds.get(exc.status_code, "invalid_spec"),
                    "message": f"{message}: {req.method} {req.url.path}"[:300],
                }
            },
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _bad_payload(_req: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(
            {"error": {"kind": "invalid_spec", "message": f"invalid request: {problems}"}},
            status_code=422,
        )
