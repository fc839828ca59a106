"""End-to-end fixtures: a private FLEETSERVE_HOME and ports per test, the real CLI as a
subprocess, and a check that nothing the test started is left running."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from fleetserve.client import Client
from fleetserve.controller.settings import Settings

SERVER = textwrap.dedent(
    """
    import json, os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    RID = os.environ["FLEETSERVE_REPLICA_ID"]
    VERSION = os.environ.get("FLEETSERVE_VERSION", "?")
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = json.dumps({"replica": RID, "version": VERSION, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)


# Ports the tests choose (controllers' API ports, servers of their own) come from a range
# below the kernel's ephemeral ports (32768 and up here), a slice per parallel worker
# (pytest-xdist's gw0, gw1, ...): a port a test picks, frees and binds again a moment later
# (a controller restarted after kill -9) is then never taken meanwhile by another worker's
# process, whose ports the kernel picks from the ephemeral range.
PORT_SLICE = 1500
PORT_BASE = 20000


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = PORT_BASE + PORT_SLICE * (index % 8)
    for _ in range(200):
        port = random.randrange(low, low + PORT_SLICE)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}..{low + PORT_SLICE - 1}")


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Fleet:
    home: Path
    env: dict[str, str]
    workdir: Path

    def cli(
        self, *args: str, timeout: float = 90, check: bool = True, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "fleetserve", *args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"fleetserve {' '.join(args)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def cli_background(self, *args: str) -> subprocess.Popen[str]:
        """The CLI in the background (output discarded): for commands a test interrupts."""
        return subprocess.Popen(
            [sys.executable, "-m", "fleetserve", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def write_service(self, name: str, body: str) -> Path:
        path = self.home.parent / f"{name}.yaml"
        path.write_text(textwrap.dedent(body))
        return path

    def client(self) -> Client:
        return Client(settings=Settings.from_env_dict(self.env), auto_start=False)

    def auth(self) -> dict[str, str]:
        """The header every API call but /health needs (the token is in the 0600 file)."""
        return {"Authorization": f"Bearer {(self.home / 'api-token').read_text().strip()}"}

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.env['FLEETSERVE_API_PORT']}/api/v1"

    def controller_pid(self) -> int:
        return int(json.loads((self.home / "server.json").read_text())["pid"])

    def processes(self) -> list[psutil.Process]:
        """Every live process started for this home (replicas, LBs, the controller)."""
        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
                if (
                    env.get("FLEETSERVE_HOME") == str(self.home)
                    and p.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return [p for p in found if p.pid != os.getpid()]

    def wait_for(self, what: str, check: object, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(check) and check():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def endpoint_of(output: str) -> str:
    m = re.search(r"Endpoint: (https?://\S+)", output)
    assert m, f"no endpoint in:\n{output}"
    return m.group(1)


def fleet_in(tmp_path: Path) -> Iterator[Fleet]:
    """A private home, ports and workdir under `tmp_path`; on exit, everything it started is
    stopped, and what was still running fails the test."""
    home = tmp_path / "home"
    workdir = tmp_path / "app"
    workdir.mkdir()
    (workdir / "server.py").write_text(SERVER)
    env = dict(os.environ)
    env.update(
        {
            "FLEETSERVE_HOME": str(home),
            "FLEETSERVE_API_PORT": str(free_port()),
            "FLEETSERVE_LB_PORT_START": str(free_port()),
            "FLEETSERVE_TERMINATE_GRACE": "3",
            "FLEETSERVE_PROBE_INTERVAL": "1",
            "NO_COLOR": "1",
            # Replicas that run `python3` get this environment's interpreter and packages.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    f = Fleet(home=home, env=env, workdir=workdir)
    yield f
    # Leave nothing behind, and fail the test if something was left.
    if (home / "server.json").exists():
        f.cli("down", "--all", "--purge", check=False)
        f.cli("server", "stop", check=False)
    leftovers = f.processes()
    described = []
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            described.append((p.pid, p.cmdline()))
            p.kill()
    assert not described, f"processes left running: {described}"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield from fleet_in(tmp_path)
