"""Bounded steps and bounded disk, end to end: a setup that never ends, a target of a
thousand replicas, a replica that logs without end, and what `down` leaves behind."""

from __future__ import annotations

import sqlite3
import time
import urllib.request

import pytest

from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e


def test_a_setup_that_never_ends_fails_with_the_reason_and_up_shows_its_progress(
    fleet: Fleet,
) -> None:
    spec = fleet.write_service(
        "stuck",
        f"""\
        service:
          readiness_probe: /health
          replicas: 1
          launch_timeout_seconds: 4
        workdir: {fleet.workdir}
        setup: |
          echo "downloading weights 10%"
          sleep 3600
        run: python3 server.py
        """,
    )
    started = time.monotonic()
    proc = fleet.cli("up", str(spec), "-n", "stuck", check=False, timeout=120)
    assert proc.returncode != 0
    # Progress goes to stderr when piped: stdout keeps only the result.
    assert "Ctrl-C stops watching" in proc.stderr
    assert "downloading weights 10%" in proc.stderr  # the setup's last line, while it waits
    assert "setup did not finish within 4 s" in proc.stdout + proc.stderr
    assert "FAILED" in proc.stderr
    assert time.monotonic() - started < 90
    reasons = [r.reason or "" for r in fleet.client().service("stuck").replicas]
    assert any("launch timeout" in r for r in reasons), reasons
    assert not [p for p in fleet.processes() if "sleep" in " ".join(p.cmdline())]


def test_a_thousand_replicas_are_written_only_as_launch_slots_free_up(fleet: Fleet) -> None:
    fleet.env["FLEETSERVE_MAX_LAUNCHES"] = "2"
    spec = fleet.write_service(
        "big",
        f"""\
        service:
          readiness_probe: /health
          replicas: 1000
        workdir: {fleet.workdir}
        setup: sleep 3600
        run: python3 server.py
        """,
    )
    fleet.cli("up", "-d", str(spec), "-n", "big")
    for _ in range(10):
        started = time.monotonic()
        with urllib.request.urlopen(f"{fleet.api}/health", timeout=5) as r:
            assert r.status == 200
        assert time.monotonic() - started < 1.0  # the controller's loop stays free
        with sqlite3.connect(fleet.home / "fleetserve.db") as db:
            count = db.execute("SELECT count(*) FROM replicas").fetchone()[0]
        assert count <= 2  # two launching at a time, and no row waiting beyond them
        time.sleep(0.3)
    fleet.cli("down", "big", timeout=120)


def test_logs_rotate_at_the_cap_and_go_with_their_service(fleet: Fleet) -> None:
    cap = 400_000
    fleet.env["FLEETSERVE_LOG_CAP_BYTES"] = str(cap)
    (fleet.workdir / "noisy.py").write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, 'server.py'])  # answers the probe\n"
        "for i in range(100000):  # about 110 KB/s for 90 s\n"
        "    print('line', i, 'x' * 100, flush=True)\n"
        "    time.sleep(0.001)\n"
        "time.sleep(3600)\n"
    )
    spec = fleet.write_service(
        "noisy",
        f"""\
        service:
          readiness_probe: /health
          replicas: 1
        workdir: {fleet.workdir}
        run: python3 noisy.py
        """,
    )
    fleet.cli("up", str(spec), "-n", "noisy")
    log = fleet.home / "logs" / "noisy" / "replica-1.log"
    rotated = log.with_name("replica-1.log.1")
    fleet.wait_for("a rotation", rotated.exists, timeout=60)
    time.sleep(6)  # another round of checks while it keeps writing
    # Half the cap, plus what it writes between two checks (5 s): bounded either way.
    assert log.stat().st_size < 3 * cap
    assert rotated.stat().st_size < 3 * cap
    tail = list(fleet.client().replica_logs("noisy", 1, tail=3))
    assert len(tail) == 3 and all(line.startswith("line ") for line in tail), tail
    fleet.cli("down", "noisy", timeout=120)
    assert not (fleet.home / "logs" / "noisy").exists()
    assert not (fleet.home / "replicas" / "noisy").exists()
