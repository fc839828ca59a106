"""One way to find every controller of a home (issue: an HA controller was invisible to
`server stop` and `server status` unless FLEETSERVE_HA was set the same way): the CLI finds a
home's controllers whatever FLEETSERVE_HA and FLEETSERVE_API_PORT say, shows where each
really listens, and a controller with high availability and one without never share a home."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import Fleet, free_port, port_in_use

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~20-35 s on a busy machine


def tls_files(tmp_path: Path) -> tuple[str, str]:
    import trustme

    cert = trustme.CA().issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def test_an_ha_controller_is_found_without_fleetserve_ha(tmp_path: Path, fleet: Fleet) -> None:
    plain = dict(fleet.env)
    ha = {**plain, "FLEETSERVE_HA": "1"}
    port = int(plain["FLEETSERVE_API_PORT"])
    cert, key = tls_files(tmp_path)
    try:
        fleet.env = ha
        fleet.cli("server", "start", "--host", "0.0.0.0", "--tls-cert", cert, "--tls-key", key)
        shown = fleet.cli("server", "status").stdout
        assert f"https://0.0.0.0:{port}" in shown and "active" in shown, shown
        assert "127.0.0.1" not in shown

        fleet.env = plain  # FLEETSERVE_HA unset: the same controller, not "none"
        shown = fleet.cli("server", "status").stdout
        assert f"https://0.0.0.0:{port}" in shown and "running" in shown, shown
        assert fleet.cli("status").returncode == 0
        down = fleet.cli("down", "--all")
        assert "No services to take down" in down.stdout, down.stdout + down.stderr
        # Another port here: the client uses the home's controller, and starts none there.
        other = free_port()
        fleet.env = {**plain, "FLEETSERVE_API_PORT": str(other)}
        listed = fleet.cli("status")
        assert "No services" in listed.stdout and not port_in_use(other), listed.stderr
        fleet.env = plain
        # A controller without high availability is not started beside it, on any port.
        mixed = fleet.cli("server", "start", "--port", str(other), check=False)
        assert mixed.returncode == 1, mixed.stdout + mixed.stderr
        assert "high availability" in mixed.stderr and "Traceback" not in mixed.stderr
        assert not port_in_use(other)

        pid = int(shown.split("(pid ")[1].split(")")[0])
        stopped = fleet.cli("server", "stop").stdout
        assert f"pid {pid}" in stopped and f"https://0.0.0.0:{port}" in stopped, stopped
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert not port_in_use(port)
        assert "No controller is running" in fleet.cli("server", "stop").stdout
        assert fleet.cli("server", "status", check=False).returncode == 1

        # The other way round: one without high availability; HA commands find it.
        fleet.cli("server", "start")
        again = fleet.cli("server", "start", "--port", str(other)).stdout  # one per home
        assert "already running" in again and f"127.0.0.1:{port}" in again, again
        assert not port_in_use(other)
        fleet.env = {**ha, "FLEETSERVE_API_PORT": str(other)}
        mixed = fleet.cli("server", "start", check=False)
        assert mixed.returncode == 1 and "high availability" in mixed.stderr, mixed.stderr
        assert not port_in_use(other)
        shown = fleet.cli("server", "status").stdout
        assert f"http://127.0.0.1:{port}" in shown and "running" in shown, shown
        assert f"http://127.0.0.1:{port}" in fleet.cli("server", "stop").stdout
        assert not port_in_use(port)
    finally:
        fleet.env = plain
        fleet.cli("server", "stop", check=False)


def test_starts_at_the_same_moment_leave_one_controller_and_say_so(fleet: Fleet) -> None:
    """Three `server start` at once: one starts the controller, the others say it is already
    running (all exit 0), and one controller runs (each used to say it had started one)."""
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fleetserve", "server", "start"],
            env=fleet.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    said = [o for o, _ in outs]
    started = [o for o in said if "Controller started (pid" in o]
    assert len(started) == 1, said
    pid = int(started[0].split("(pid ")[1].split(")")[0])
    for o in said:
        assert f"(pid {pid})" in o or "already running" in o, said
    status = fleet.cli("server", "status").stdout
    assert f"pid {pid}" in status, status
    fleet.cli("server", "stop")
