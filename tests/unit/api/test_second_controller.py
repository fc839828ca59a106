"""A controller started for a home whose controller runs on another port (a second
FLEETSERVE_API_PORT) refuses with that port and how to reach it, exit 5, and the CLI says so
(it said "another fleetserve controller is running for HOME", exit 1, without the port)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fleetserve.home.folder import secure_home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_second_port_for_one_home_names_the_running_controllers_port(tmp_path: Path) -> None:
    home = tmp_path / "home"
    secure_home(home)
    running, other = free_port(), free_port()
    # This test's process stands in for the running controller: it holds the home's lock
    # and is who server.json names (its start time does not match: no wait for an answer).
    (home / "server.json").write_text(
        json.dumps({"pid": os.getpid(), "create_time": 1.0, "port": running})
    )
    with open(home / "server.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        env = {
            **os.environ,
            "FLEETSERVE_HOME": str(home),
            "FLEETSERVE_API_PORT": str(other),
        }
        env.pop("FLEETSERVE_API_URL", None)
        cli = subprocess.run(
            [sys.executable, "-m", "fleetserve", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert cli.returncode == 5, cli.stderr
    assert "Traceback" not in cli.stderr
    message = " ".join(cli.stderr.split())
    assert f"another fleetserve controller is running for {home} on port {running}" in message
    assert f"not {other}" in message
    assert f"set FLEETSERVE_API_PORT={running}" in message
    assert f"`FLEETSERVE_API_PORT={running} fleetserve server stop`" in message
