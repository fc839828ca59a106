"""`python -m fleetserve.api.server`: the controller process (REST API + reconcilers).

Started in the background by the CLI (`fleetserve server start`, or on demand). One controller
per FLEETSERVE_HOME: a lock file keeps a second one from starting. Everything it writes is
the owner's only (umask 077, home 0700); the replicas keep the user's own umask.

A start that cannot go on (another controller, a busy port, an unusable database, a public
address without TLS) prints one line, exits non-zero and touches nothing: no process, no
server.json, no log of the running controller.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import socket
import ssl
import sys
from typing import NoReturn

import psutil
import uvicorn

from fleetserve.api.app import create_app
from fleetserve.api.connections import Admission, protocol_class, token_check
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings
from fleetserve.core.errors import FleetserveError, InvalidSpec
from fleetserve.home.folder import ensure_token, running_controllers, secure_home
from fleetserve.home.settings import DEFAULT_API_PORT
from fleetserve.infra.base import Infra
from fleetserve.oshelpers.procs import started

EXIT_REFUSED = 2
EXIT_OTHER_CONTROLLER = 5  # the home's controller runs: reach that one (like "unreachable")
MAX_HEADER_BYTES = 64 * 1024  # request line and headers of one request
KEEP_ALIVE_SECONDS = 30  # an idle keep-alive connection is closed after this


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context from --tls-cert / --tls-key, None without them."""
    if not settings.tls_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_certfile, settings.tls_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise InvalidSpec(
            f"cannot use the TLS certificate {settings.tls_certfile} and key "
            f"{settings.tls_keyfile}: {getattr(e, 'strerror', None) or e}"
        ) from None
    return context


def _refuse(message: str, code: int = EXIT_REFUSED) -> NoReturn:
    """One line on stderr (the CLI that started us shows it) and in the log (stdout)."""
    line = f"fleetserve controller: {message}"
    print(line, file=sys.stderr, flush=True)
    if not sys.stdout.isatty():
        print(line, flush=True)
    sys.exit(code)


def _another_controller(settings: Settings) -> str:
    """Why this controller does not start: the home's running one, its port and how to
    reach it (a second FLEETSERVE_API_PORT for the same home, say)."""
    try:
        info = json.loads(settings.server_file.read_text())
        port, pid = int(info["port"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"another fleetserve controller is running for {settings.home} (its port is not "
            f"known: {settings.server_file} is missing); stop it with `fleetserve server stop` "
            "and its FLEETSERVE_API_PORT"
        )
    if port == settings.api_port:
        return (
            f"another fleetserve controller is running for {settings.home} on port {port} "
            f"(pid {pid}); use it, or stop it first with `fleetserve server stop`"
        )
    reach = (
        "unset FLEETSERVE_API_PORT (it runs on the default port)"
        if port == DEFAULT_API_PORT
        else f"set FLEETSERVE_API_PORT={port}"
    )
    return (
        f"another fleetserve controller is running for {settings.home} on port {port} (pid "
        f"{pid}), not {settings.api_port}: one controller per FLEETSERVE_HOME. To use it, "
        f"{reach}; to move it, stop it first with `FLEETSERVE_API_PORT={port} fleetserve "
        "server stop`"
    )


def _mixed(settings: Settings, kind: str) -> str:
    others = (
        ", ".join(f"pid {c.pid} on {c.where}" for c in running_controllers(settings.home))
        or "starting"
    )
    wanted = "with" if kind == "without" else "without"
    return (
        f"a controller {kind} high availability (FLEETSERVE_HA) runs for {settings.home} "
        f"({others}): this one, {wanted} it, cannot share its home; stop it first "
        "(`fleetserve server stop`) or start this one the same way"
    )


def bind(settings: Settings) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.api_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.api_host, settings.api_port))
    except OSError as e:
        sock.close()
        raise InvalidSpec(
            f"cannot listen on {settings.api_host}:{settings.api_port} ({e.strerror}): "
            "set FLEETSERVE_API_PORT to another port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(infra: Infra | None = None) -> None:
    """Run the controller until SIGTERM. `infra` replaces the local infra as the default one
    (the one injection point for a fake infra: bench/controller runs the real controller, API
    and store over fake replicas with it); the CLI always starts it with none."""
    user_umask = os.umask(0o077)
    try:
        settings = Settings.from_env()
        settings.check_exposure()
    except FleetserveError as e:
        _refuse(e.message)
    try:
        secure_home(settings.home)
    except FleetserveError as e:
        _refuse(e.message, e.exit_code)
    lock = open(settings.lock_file, "a")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not settings.ha and any(c.ha for c in running_controllers(settings.home)):
            _refuse(_mixed(settings, "with"), 1)
        _refuse(_another_controller(settings), EXIT_OTHER_CONTROLLER)
    # With high availability, every controller of the home also holds server.lock shared:
    # one without it (which holds it alone) and these never run on one home together.
    locks = [lock]  # held for the process's life
    if settings.ha:
        locks.append(open(settings.home / "server.lock", "a"))  # noqa: SIM115
        try:
            fcntl.flock(locks[-1], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            _refuse(_mixed(settings, "without"), 1)
    elif any(c.ha for c in running_controllers(settings.home)):  # one that holds no lock
        _refuse(_mixed(settings, "with"), 1)
    try:
        sock = bind(settings)
        controller = Controller(settings, replica_umask=user_umask, infra=infra)
    except FleetserveError as e:
        _refuse(e.message, e.exit_code)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    me = psutil.Process()
    info = {
        "pid": me.pid,
        "create_time": started(me),
        "port": settings.api_port,
        "host": settings.api_host,
        "scheme": settings.api_scheme,
    }

    def publish() -> None:
        # Only once the controller has started: a failed start leaves the file as it was.
        # From now on stray stderr output (the CLI stops reading it) goes to the log too.
        sys.stderr.flush()
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
        text = json.dumps(info)
        tmp = settings.server_file.with_suffix(".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, settings.server_file)
        except OSError as e:
            # A full disk: the controller still serves (on its port, where the CLI looks
            # first), so that `down` can stop the processes that filled it. The old file,
            # rewritten in place, reuses its own blocks; else no file names it for now.
            with contextlib.suppress(OSError):
                tmp.unlink()
            try:
                with open(
                    settings.server_file, "r+" if settings.server_file.exists() else "w"
                ) as f:
                    f.truncate(0)
                    f.write(text)
            except OSError:
                logging.getLogger("fleetserve.controller").warning(
                    "cannot write %s (%s): clients find this controller on port %s only",
                    settings.server_file,
                    e.strerror or e,
                    settings.api_port,
                )

    def forget_server_file() -> None:
        # uvicorn re-raises SIGTERM once shut down, so this runs from the lifespan's end.
        try:
            current = json.loads(settings.server_file.read_text())
            if current.get("pid") == me.pid:
                settings.server_file.unlink()
        except (OSError, ValueError):
            pass
        logging.getLogger("fleetserve.controller").info("controller stopped")

    try:
        token = ensure_token(settings.token_file)
    except FleetserveError as e:
        _refuse(e.message, e.exit_code)
    app = create_app(controller, on_stopped=forget_server_file, token=token, on_started=publish)
    try:
        tls = tls_context(settings)
    except FleetserveError as e:
        _refuse(e.message)
    # Each connection is admitted, and its head timed, by fleetserve.api.connections: a
    # client without the token can hold only so many, for so long (TLS is done there too).
    admission = Admission(
        token_check(token, app.state.sessions.valid),
        tls=tls,
        header_seconds=settings.api_header_timeout,
        max_connections=settings.api_max_connections,
        max_per_client=settings.api_max_client_connections,
    )
    config = uvicorn.Config(
        app,
        # h11, not httptools: it bounds what a client may send before a request is complete
        # (headers included), so no one fills the controller's memory before the token check.
        http=protocol_class(admission),
        ws="none",
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        limit_concurrency=settings.api_max_connections,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    logging.getLogger("fleetserve.controller").info(
        "controller starting on %s://%s:%s (home %s, home id %s, host %s, store %s)",
        settings.api_scheme,
        settings.api_host,
        settings.api_port,
        settings.home,
        controller.home_id,
        controller.host,
        controller.store.where,  # a PostgreSQL URL without its password
    )
    if controller.store.joined is not None:
        logging.getLogger("fleetserve.controller").info(
            "high availability across homes: this home joined the home id %s of the database, "
            "first claimed by the home %s",
            controller.home_id,
            controller.store.joined,
        )
    # What exists by now (modules, the app, the store) lives as long as the process: kept out
    # of the garbage collector's full passes, which otherwise walk it all again and again
    # (pauses of 100 ms with a thousand replicas; docs/scaling.md).
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(1)


if __name__ == "__main__":
    main()
