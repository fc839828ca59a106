"""`python -m fleetserve.api.server`: the controller process (REST API + reconcilers).

Started in the background by the CLI (`fleetserve server start`, or on demand). One controller
per FLEETSERVE_HOME: a lock file keeps a second one from starting.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys

import psutil
import uvicorn

from fleetserve.api.app import create_app
from fleetserve.controller.controller import Controller
from fleetserve.controller.settings import Settings


def main() -> None:
    settings = Settings.from_env()
    settings.home.mkdir(parents=True, exist_ok=True)
    lock = open(settings.home / "server.lock", "w")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another fleetserve controller is running for {settings.home}", file=sys.stderr)
        sys.exit(1)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    me = psutil.Process()

    def forget_server_file() -> None:
        # uvicorn re-raises SIGTERM once shut down, so this runs from the lifespan's end.
        try:
            current = json.loads(settings.server_file.read_text())
            if current.get("pid") == me.pid:
                settings.server_file.unlink()
        except (OSError, ValueError):
            pass
        logging.getLogger("fleetserve.controller").info("controller stopped")

    controller = Controller(settings)
    app = create_app(controller, on_stopped=forget_server_file)
    info = {"pid": me.pid, "create_time": me.create_time(), "port": settings.api_port}
    tmp = settings.server_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, settings.server_file)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=settings.api_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    logging.getLogger("fleetserve.controller").info(
        "controller starting on 127.0.0.1:%s (home %s)", settings.api_port, settings.home
    )
    server.run()
    if not server.started:
        sys.exit(1)


if __name__ == "__main__":
    main()
